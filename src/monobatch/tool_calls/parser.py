"""Tool requests' output side: a reply's streamed text split into content and tool calls."""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from json.decoder import WHITESPACE, scanstring
from typing import Any

from monobatch.tool_calls.request import (HERMES_CLOSE, HERMES_OPEN, MISTRAL_OPEN, PYTHON_TAG, ToolFormat, ToolSpec,
                                          grammar_enforced)

_ID_CHARS = string.ascii_letters + string.digits
#: What the json module raises on text that is no JSON value: ValueError, and RecursionError for
#: arrays or objects nested deeper than the interpreter's recursion limit (a model looping on "[").
JSON_ERRORS = (ValueError, RecursionError)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: ``arguments`` is JSON text of an object, or, for a call ``max_tokens`` cut after
    its name (``ToolCallParser.cut``, finish_reason ``length``), the arguments' text as far as it
    came (OpenAI's reply when ``max_tokens`` cuts a forced call)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        """The ``message.tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of call ``index``: the first carries ``id`` and ``name``, later ones only
    ``arguments`` pieces (joined they are the call's ``arguments``). :class:`ToolCallParser`
    reports each call whole, in one delta with all three."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        """The streaming ``delta.tool_calls`` entry."""
        fn = ({"name": self.name} if self.name is not None else {}) | {"arguments": self.arguments}
        head = {"id": self.id, "type": "function"} if self.id is not None else {}
        return {"index": self.index, **head, "function": fn}


@dataclass(slots=True)
class ToolDelta:
    """What one :meth:`ToolCallParser.feed` adds: content text and call pieces."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def __iadd__(self, other: "ToolDelta") -> "ToolDelta":
        self.content += other.content
        self.calls.extend(other.calls)
        return self


def new_call_id() -> str:
    """An OpenAI-like call id: ``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


class ToolCallParser:
    """Splits one reply's streamed text into content and tool calls (see the module docstring
    for each format's markers and the decisions on partial text).

    Text that could still be a marker is held back until decided; a call's JSON is held until
    it is complete (or the reply ends: :meth:`flush` reports a call ``max_tokens`` cut after its
    name). Calls past ``spec.max_calls`` (one with ``parallel_tool_calls: false`` or a
    named function) are dropped, as vLLM does: where a grammar enforces the calls there are none,
    but ``auto`` in a marker format runs without one. Whitespace right before a marker is dropped, and so is whitespace after a
    call while no content came before, and the trailing whitespace of a reply with calls. With
    no tools or choice "none" every piece passes through as content.

    Args:
        spec: the checked tools (None: no tools).
        fmt: the model's format.
    """

    def __init__(self, spec: ToolSpec | None, fmt: ToolFormat) -> None:
        self._fmt, self._pass = fmt, spec is None or not spec.active
        self._forced = grammar_enforced(spec, fmt)  # the reply holds only the format's text (and GENERIC's response)
        self._names = {t["function"]["name"] for t in spec.tools} if spec else set()
        self._max_calls = spec.max_calls if spec else 0  # calls reported at most (later ones dropped)
        self._marker = {ToolFormat.HERMES: HERMES_OPEN, ToolFormat.MISTRAL: MISTRAL_OPEN}.get(fmt)
        self._state = "text" if self._marker else "start"
        self._held = ""       # text not yet decided
        self._raw = ""        # consumed as a would-be call, not yet emitted (content if it fails)
        self._content = ""
        self._strip = False   # after a call: drop whitespace while no content came before
        self._alts: list = []  # state "after": (parts, next state) continuations
        self._in_list = False  # MISTRAL: inside [TOOL_CALLS][ ... ]
        self._depth = self._pos = 0
        self._in_str = self._esc = False
        self._calls: list[ToolCall] = []
        self._cut = False     # flush found a call begun and not finished

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls reported so far."""
        return list(self._calls)

    @property
    def has_calls(self) -> bool:
        """Whether any call was reported (the caller's ``finish_reason`` "tool_calls")."""
        return bool(self._calls)

    @property
    def cut(self) -> bool:
        """Whether the reply ended inside a call (after :meth:`flush`): its marker or JSON had
        begun and did not complete (``max_tokens``, a stop string). The cut call is reported when
        ``max_tokens`` cut it after its name (:meth:`flush`); calls complete before it are reported
        too."""
        return self._cut

    @property
    def content(self) -> str:
        """All content emitted so far (the reply's ``message.content`` after :meth:`flush`)."""
        return self._content

    def feed(self, text: str) -> ToolDelta:
        """Add the next piece of the reply; returns what can be shown now."""
        out = ToolDelta()
        if self._pass:
            self._emit(out, text, strip=False)
            return out
        self._held += text
        while self._held and self._advance(out):
            pass
        return out

    def flush(self, finish_reason: str) -> ToolDelta:
        """End of the reply: release held text. ``finish_reason``: the engine's (``stop``,
        ``length``, ...).

        A call the end cut is reported only when ``max_tokens`` (or the context) cut it
        (``length``), as OpenAI replies then: cut after its name was complete, the call, its
        ``arguments`` the arguments' text as far as it came (not JSON; :func:`_cut_call`). Any
        other end inside a call (a stop string: ``stop``, which is also what a complete call's
        reply ends with under a named function, so a client could not tell the call was cut), and
        ``length`` before its name was complete, report no call for it. Its text is then dropped
        where a grammar held the reply to the format
        (:func:`~monobatch.tool_calls.request.grammar_enforced`: "required", a named function,
        GENERIC's "auto"): it is the format's wrapper, the engine's and not the model's text, and
        OpenAI never answers a forced call with content (the reply has none). Otherwise ("auto" in
        a model's own format, which may have been writing text) it is content, raw, markers
        included, as vLLM does. ``cut`` is then true either way (calls complete before it stay
        calls). A dangling partial marker (two or more characters) is dropped (G2)."""
        out, held, state = ToolDelta(), self._held, self._state
        self._held, self._state = "", "plain"
        call = _cut_call(held, self._names if self._fmt is ToolFormat.LLAMA3_JSON else None) \
            if finish_reason == "length" and state == "call" else None
        if call is not None:
            self._cut = True
            self._report(out, *call)
        elif self._forced and state in ("text", "start", "open", "mopen", "call"):
            self._cut = state not in ("text", "start") or bool(held.strip())  # the wrapper of a call begun: dropped
        elif state in ("text", "start") and self._fmt is not ToolFormat.GENERIC:
            keep = partial_suffix(held, self._marker or PYTHON_TAG)
            held = held[:-keep].rstrip() if keep >= 2 else held
            self._cut = keep >= 2 and bool(self._calls)  # a further call's marker had begun
            self._emit(out, held.rstrip() if self._calls else held)
        elif state in ("start", "open", "mopen", "call"):
            self._cut = state != "start"  # a marker, a separator or a call's "{" began one
            self._emit(out, self._raw + held)
        self._raw = ""  # "after" and "response" hold only a partial separator or escape: dropped
        return out

    # -- the state machine: each step consumes text or changes state; False waits for more --
    def _advance(self, out: ToolDelta) -> bool:
        held, state, fmt = self._held, self._state, self._fmt
        if state == "plain":
            self._emit(out, held)
            self._held = ""
        elif state == "text":  # HERMES / MISTRAL: content until the marker
            k = held.find(self._marker)
            if k < 0:
                piece = held[:len(held) - partial_suffix(held, self._marker)].rstrip()
                self._emit(out, piece)
                self._held = held[len(piece):]
                return False
            piece = held[:k].rstrip()
            self._emit(out, piece)  # the whitespace before the marker is the call's (dropped)
            self._raw, self._held = held[len(piece):k] + self._marker, held[k + len(self._marker):]
            self._state = "mopen" if fmt is ToolFormat.MISTRAL else "open"
        elif state == "start" and fmt is ToolFormat.LLAMA3_JSON:  # a call starts the reply or none
            end = _match_seq(held, [PYTHON_TAG])
            if end == -1:
                return False
            if end is not None:
                self._raw, self._held, self._state = held[:end], held[end:], "open"
            else:
                self._state = "open" if held.lstrip().startswith("{") else "plain"
        elif state == "start":  # GENERIC: {"tool_calls": [ or {"response": "
            calls = _match_seq(held, ["{", '"tool_calls"', ":", "["])
            resp = _match_seq(held, ["{", '"response"', ":", '"'])
            if calls is not None and calls >= 0:
                self._raw, self._held, self._state = held[:calls], held[calls:], "open"
            elif resp is not None and resp >= 0:
                self._held, self._state = held[resp:], "response"
            elif calls == -1 or resp == -1:
                return False
            else:
                self._state = "plain"
        elif state in ("open", "mopen"):  # a call's "{" (MISTRAL after its marker: or a "[")
            body = held.lstrip()
            if not body:
                return False
            skip = len(held) - len(body)
            if body[0] == "{":
                self._raw += held[:skip]
                self._held, self._state = body, "call"
                self._depth = self._pos = 0
                self._in_str = self._esc = False
            elif body[0] == "[" and state == "mopen":
                self._raw += held[:skip + 1]
                self._held, self._state, self._in_list = body[1:], "open", True
            else:
                self._fail(out)
        elif state == "call":
            end = self._scan()
            if end is None:
                return False
            self._held = held[end:]
            call = _parse_call(held[:end], self._names if fmt is ToolFormat.LLAMA3_JSON else None)
            if call is None:
                self._raw += held[:end]
                self._fail(out)
                return True
            self._report(out, *call)
            self._raw, self._strip, self._state = "", True, "after"
            self._alts = {ToolFormat.HERMES: [([HERMES_CLOSE], "text")],
                          ToolFormat.LLAMA3_JSON: [([";"], "open")],
                          ToolFormat.GENERIC: [([","], "open"), (["]", "}"], "plain")],
                          ToolFormat.MISTRAL: [([","], "open"), (["]"], "text")] if self._in_list else []}[fmt]
        elif state == "after":  # a separator, an end marker, or the rest is content
            ends = [(_match_seq(held, parts), nxt) for parts, nxt in self._alts]
            hit = next(((e, nxt) for e, nxt in ends if e is not None and e >= 0), None)
            if hit:
                self._held, self._state = held[hit[0]:], hit[1]
                self._in_list = self._in_list and hit[1] == "open"
            elif any(e == -1 for e, _ in ends):
                return False
            else:
                self._state, self._in_list = "text" if self._marker else "plain", False
        else:  # "response": GENERIC's reply string, decoded as it comes
            end = _whole_chars(held)
            self._emit(out, _decode_str(held[:end]), strip=False)
            self._held = held[end:]
            if not self._held.startswith('"'):
                return False
            self._held, self._state, self._alts, self._strip = self._held[1:], "after", [(["}"], "plain")], True
        return True

    def _report(self, out: ToolDelta, name: str, arguments: str) -> None:
        """Report a call (a fresh id), unless it is past ``spec.max_calls`` (auto without a grammar: dropped)."""
        if len(self._calls) < self._max_calls:
            self._calls.append(ToolCall(new_call_id(), name, arguments))
            out.calls.append(ToolCallDelta(len(self._calls) - 1, self._calls[-1].id, name, arguments))

    def _emit(self, out: ToolDelta, text: str, strip: bool = True) -> None:
        if strip and self._strip and not self._content:
            text = text.lstrip()
        if text:
            self._strip = False
            self._content += text
            out.content += text

    def _fail(self, out: ToolDelta) -> None:
        """What was consumed as a would-be call was not one: it is content after all."""
        raw, self._raw, self._in_list = self._raw, "", False
        self._state = "text" if self._marker else "plain"
        self._emit(out, raw)

    def _scan(self) -> int | None:
        """End (exclusive) of the JSON value at the start of ``_held``, None while incomplete."""
        held, i = self._held, self._pos
        while i < len(held):
            c = held[i]
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
            i += 1
        self._pos = i
        return None


#: The longest run of whole characters and escapes of a JSON string's body.
_STR_BODY = re.compile(r'(?:[^"\\]|\\u[0-9a-fA-F]{4}|\\[^u])*')
_HIGH_SURROGATE = re.compile(r"(?:^|[^\\])(?:\\\\)*\\u[dD][89abAB][0-9a-fA-F]{2}$")  # an unescaped "\\u"
#: What :func:`_whole_chars` leaves of a string the reply cut: a high surrogate whose low half did
#: not come, then the start of an escape (a backslash, or ``\\u`` and fewer than four hex digits).
_CUT_TAIL = re.compile(r"(?:\\u[dD][89abAB][0-9a-fA-F]{2})?(?:\\(?:u[0-9a-fA-F]{0,3})?)?")
#: The keys of a call object that hold its arguments (Llama's ``parameters``).
_ARGUMENT_KEYS = ("arguments", "parameters")
#: A surrogate code point. In a str the ``json`` module decoded it is half of a pair whose other
#: half did not come: ``"\\ud83dx"`` decodes to ``"\ud83dx"``, which is no UTF-8 text.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _utf8_text(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD, as a UTF-8 decoder replaces a bad
    byte: text the response's UTF-8 encoding takes (a lone surrogate there was a 500). JSON's
    grammar allows any ``\\uXXXX`` escape, so a grammar-forced call may hold one; it stays the call,
    its arguments still JSON. Applied wherever the parser decodes a model's JSON string (a call's
    name and arguments, whole or cut, and GENERIC's ``response``), each to whole characters only
    (:func:`_whole_chars`), so streamed and non-streamed replies get the same text."""
    return _SURROGATE.sub("\ufffd", text)


def _whole_chars(body: str) -> int:
    """End of the longest prefix of a JSON string's ``body`` (the text after its opening quote)
    that ends on a whole character: at the closing quote when it came; else before an escape
    that has not come whole, and before a ``\\uD8xx`` high surrogate whose low half may follow."""
    end = _STR_BODY.match(body).end()
    if _HIGH_SURROGATE.search(body, 0, end) and not body.startswith('"', end):
        end -= 6
    return end


def _decode_str(body: str) -> str:
    try:
        return _utf8_text(json.loads(f'"{body}"', strict=False))
    except ValueError:
        return body


class _NotJSON(ValueError):
    """``NaN``, ``Infinity`` or ``-Infinity``: the ``json`` module reads them, JSON has none."""


def _reject_constant(name: str) -> Any:
    raise _NotJSON(f"{name} is not JSON")


#: The ``json`` module's decoder with the calls' rule: ``NaN`` and ``Infinity`` are no JSON.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _parse_call(text: str, names: set[str] | None) -> tuple[str, str] | None:
    """(name, canonical arguments JSON) of a call object's text, or None when it is not one.
    ``names``: LLAMA3_JSON's bare JSON must name a tool and carry arguments to count."""
    try:
        obj = _DECODER.decode(text)
    except JSON_ERRORS:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    if names is not None and (obj["name"] not in names or key not in obj):
        return None
    args = _arguments(obj.get(key, {}))
    if args is None:
        return None
    return _utf8_text(obj["name"]), _utf8_text(json.dumps(args, ensure_ascii=False))


def _arguments(value: Any) -> dict | None:
    """A call's whole arguments value as a call takes it: an object, or a JSON string whose text is
    one (``NaN`` and ``Infinity`` refused); None for anything else (``"hello"``, ``[1, 2]``, ``42``)."""
    if isinstance(value, str):
        try:
            value = _DECODER.decode(value)
        except JSON_ERRORS:
            return None
    return value if isinstance(value, dict) else None


def _opens_object(text: str) -> bool:
    """Whether ``text`` could begin a JSON object: nothing yet, or ``{`` after whitespace."""
    return text[WHITESPACE.match(text).end():][:1] in ("", "{")


def _cut_call(text: str, names: set[str] | None) -> tuple[str, str] | None:
    """(name, arguments text so far) of a call object cut before its end, or None when its name
    was cut too (or it is no call object; ``names`` as :func:`_parse_call`).

    The object's keys are read in order with the ``json`` module's own scanner (``scanstring``,
    ``raw_decode``): ``name`` counts once its string is complete; the text of ``arguments`` (or
    Llama's ``parameters``) is kept as the model wrote it, from its first character to where the
    reply ended (to the value's end when it was complete): ``""`` when the cut came before it.
    Arguments written as a JSON string are its text, decoded (:func:`_cut_string`), as a complete
    call's are. The complete call's rules hold as far as the text came: arguments whose value
    completed must be what a complete call takes (:func:`_arguments`: an object, or a string whose
    text is one), and cut ones must be able to begin an object (:func:`_opens_object`: their text,
    or a string's decoded text, is empty or opens with ``{``), else it is no call (``"hello"``,
    ``[1, 2]``, ``42``, ``"[1``). ``NaN`` and ``Infinity`` are no JSON: a cut call holding one where
    the scanner read (its arguments' decoded text included) is no call.
    """
    name, args = None, ""
    i = WHITESPACE.match(text, 0).end()
    if not text.startswith("{", i):
        return None
    i += 1
    while True:
        i = WHITESPACE.match(text, i).end()
        if not text.startswith('"', i):
            break
        try:
            key, i = scanstring(text, i + 1)
        except ValueError:  # the key was cut
            break
        i = WHITESPACE.match(text, i).end()
        if not text.startswith(":", i):
            break
        i = WHITESPACE.match(text, i + 1).end()
        try:
            value, end = _DECODER.raw_decode(text, i)
        except _NotJSON:
            return None
        except JSON_ERRORS:  # the value was cut: the end of the reply (or nested past the recursion limit)
            if key in _ARGUMENT_KEYS:
                args = _cut_string(text[i + 1:]) if text.startswith('"', i) else text[i:]
                if args is None or not _opens_object(args):
                    return None
            break
        if key == "name" and isinstance(value, str):
            name = value
        elif key in _ARGUMENT_KEYS:
            if _arguments(value) is None:
                return None
            args = value if isinstance(value, str) else text[i:end]
        i = WHITESPACE.match(text, end).end()
        if not text.startswith(",", i):
            break
        i += 1
    if not name or (names is not None and name not in names):
        return None
    return _utf8_text(name), _utf8_text(args)


def _cut_string(body: str) -> str | None:
    """The text of arguments written as a JSON string the reply cut (``body``: what came after its
    opening quote), decoded by the ``json`` module's scanner as far as whole characters came
    (:func:`_whole_chars`); None when it is no JSON string (a bad escape, a control character) or
    its text holds ``NaN`` or ``Infinity`` (:func:`_holds_constant`), as :func:`_parse_call` refuses
    a complete one."""
    end = _whole_chars(body)
    if not _CUT_TAIL.fullmatch(body, end):
        return None  # not cut inside a character: the string went wrong there
    try:
        text = scanstring(body[:end] + '"', 0)[0]
    except ValueError:
        return None
    return None if _holds_constant(text) else text


def _holds_constant(text: str) -> bool:
    """Whether the ``json`` module's scanner meets ``NaN`` or ``Infinity`` in ``text`` (JSON or
    its beginning) before it ends or stops on something that is no JSON."""
    try:
        _DECODER.raw_decode(text, WHITESPACE.match(text).end())
    except _NotJSON:
        return True
    except JSON_ERRORS:
        pass
    return False


def _match_seq(text: str, parts: list[str]) -> int | None:
    """Match ``parts`` in order, whitespace allowed before each: the end index, -1 while the text
    could still match, None when it cannot."""
    i = 0
    for part in parts:
        while i < len(text) and text[i].isspace():
            i += 1
        chunk = text[i:i + len(part)]
        if not part.startswith(chunk):
            return None
        if len(chunk) < len(part):
            return -1
        i += len(part)
    return i


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(text: str, spec: ToolSpec | None, fmt: ToolFormat,
                     finish_reason: str) -> tuple[str, list[ToolCall]]:
    """The whole-text form of :class:`ToolCallParser` (non-streamed replies): (content, calls);
    ``finish_reason`` as :meth:`ToolCallParser.flush`."""
    parser = ToolCallParser(spec, fmt)
    parser.feed(text)
    parser.flush(finish_reason)
    return parser.content, parser.tool_calls
