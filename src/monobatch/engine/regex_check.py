"""A regex constraint checked before it is compiled (by :meth:`GrammarCompiler.compile`), so a
pattern that does not parse is refused with one clear line at every door (``--regex``,
``structured_outputs.regex`` / ``guided_regex``, ``StructuredOutput.regex`` in the Python API)::

    structured_outputs.regex: the regular expression "[a-" does not compile: unclosed character class

rather than llguidance's own text (``at 1(8): invalid regex "[a-" (in regex): regex parse error``,
a position in the Lark grammar it wraps the pattern in). The syntax is Rust's ``regex`` crate's
(llguidance's), not Python's ``re``: the check asks llguidance's parser, so both agree.
"""

from __future__ import annotations

import re
from monobatch.errors import InvalidRequestError

#: Characters of the pattern quoted in the message (a longer one is cut, with "...").
SHOWN_CHARS = 80


def regex_syntax_error(pattern: str) -> str | None:
    """Why ``pattern`` is not a regular expression (Rust ``regex`` syntax), in a few words, or
    None when it parses. Only the syntax: a pattern too large for the lexer is refused when it
    compiles (:meth:`GrammarCompiler.compile`)."""
    import llguidance

    if (len(pattern) - len(pattern.rstrip("\\"))) % 2:
        # an odd run of backslashes at the end escapes nothing: Rust's regex refuses it, but
        # llguidance's grammar_from_regex drops it silently ("ab\\" would constrain to "ab")
        return "incomplete escape sequence (a backslash at the end)"
    try:
        message = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_regex(pattern))
    except UnicodeEncodeError:
        return "not valid Unicode (a lone surrogate)"
    except Exception as exc:  # anything else llguidance refuses before parsing
        message = str(exc) or type(exc).__name__
    if not message:
        return None
    lines = [ln.strip() for ln in message.strip().splitlines()]
    # regex-syntax's "error: <cause>" line, below its excerpt of the pattern; else llguidance's
    # first line without its position in the wrapping grammar ("at 1(8): ")
    cause = next((ln[len("error:"):].strip() for ln in lines if ln.startswith("error:")), None)
    if not cause:
        cause = re.sub(r"^at \d+\(\d+\):\s*", "", lines[0] if lines else "").rstrip(":") or "a syntax error"
    return cause[:300]


def check_regex(pattern: str, param: str) -> None:
    """Refuse a pattern that does not parse, naming ``param`` and the cause.

    Raises:
        InvalidRequestError: ``'<param>: the regular expression "<pattern>" does not compile: <cause>'``.
    """
    cause = regex_syntax_error(pattern)
    if cause is not None:
        raise does_not_compile(pattern, param, cause)


def shown_pattern(pattern: str) -> str:
    """``pattern`` in double quotes as the user typed it (``"\\d+[a-"``: a backslash stays one
    backslash, not JSON's or ``repr``'s doubled one), cut at :data:`SHOWN_CHARS` (with "...");
    only characters that are not printable are escaped (a newline as ``\\n``, a lone surrogate as
    ``\\ud800``: the same regex, and the message stays one line that any output can encode)."""
    cut = pattern[:SHOWN_CHARS]
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in cut)
    return f'"{text}"' + ("..." if len(pattern) > SHOWN_CHARS else "")


def does_not_compile(pattern: str, param: str, cause: str) -> InvalidRequestError:
    """The error of a regex that does not compile: ``'<param>: the regular expression "<pattern>"
    does not compile: <cause>'`` (the pattern as typed: :func:`shown_pattern`), the same at every
    door (``--regex``, ``structured_outputs.regex``, ``guided_regex``, ``StructuredOutput.regex``)."""
    return InvalidRequestError(f"{param}: the regular expression {shown_pattern(pattern)} does not compile: {cause}",
                               param)
