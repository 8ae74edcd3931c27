"""The exceptions monobatch raises on purpose.

Every error a user can cause (a missing model file, an out-of-range flag, an unsupported
architecture, a prompt longer than the context) is a :class:`MonobatchError`. The CLI prints its
message as one line and exits non-zero; the server turns it into an OpenAI-shaped 4xx JSON body.
Anything else escaping is a bug.
"""

from __future__ import annotations


class MonobatchError(Exception):
    """Base class of every error monobatch raises for bad input or an unusable environment."""


class ModelNotFoundError(MonobatchError):
    """No model file or folder at the given path, or no bundled model installed."""


class UnsupportedModelError(MonobatchError):
    """The weights use an architecture, tensor type or config option monobatch does not run."""


class InsufficientMemoryError(MonobatchError):
    """The dequantized weights (or the KV cache) would not fit in the memory available."""


class InvalidRequestError(MonobatchError, ValueError):
    """A request field or CLI flag is outside its documented range (maps to HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """A prompt (or prompt + max_tokens) does not fit in the model's context (HTTP 400)."""


def require_api_key(key: str | None, source: str = "--api-key") -> None:
    """Refuse an API key that ``Authorization: Bearer KEY`` cannot carry as given: empty, or not
    printable ASCII without spaces (a header is bytes: such a key could never match, and an HTTP
    client cannot even send it). The one check of a server's key and of a client's; None (no key)
    passes.

    Args:
        source: where the key came from, named in the message (``--api-key``, ``$MONOBATCH_API_KEY``).

    Raises:
        InvalidRequestError: the key cannot be used (param ``api_key``).
    """
    if key is None:
        return
    if key == "":
        raise InvalidRequestError(f"{source} must not be empty", "api_key")
    if not (key.isascii() and key.isprintable() and " " not in key):
        raise InvalidRequestError(f"{source} must be printable ASCII without spaces", "api_key")


def first_non_utf8(text: str) -> int | None:
    """The index of the first code point in ``text`` that UTF-8 cannot encode (a lone surrogate:
    JSON's ``"\\ud800"``, or a byte that is not UTF-8 read with ``surrogateescape``, U+DC80..U+DCFF),
    or None when ``text`` is valid UTF-8 text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def where_not_utf8(text: str, escaped_bytes: bool = False) -> str | None:
    """Where ``text`` stops being UTF-8 text — ``an unpaired surrogate, U+D800, at character 1``
    (0-based), or with ``escaped_bytes`` (text read from bytes with ``surrogateescape``: a terminal,
    a file, a pipe) ``byte 0xFF at character 1`` for the code points U+DC80..U+DCFF such a read
    makes of a byte that is not UTF-8 — or None when it is valid."""
    at = first_non_utf8(text)
    if at is None:
        return None
    code = ord(text[at])
    if escaped_bytes and 0xDC80 <= code <= 0xDCFF:
        return f"byte 0x{code - 0xDC00:02X} at character {at}"
    return f"an unpaired surrogate, U+{code:04X}, at character {at}"


def require_utf8(text: str, param: str, what: str = "the prompt", escaped_bytes: bool = False) -> None:
    """Refuse text that has no UTF-8 form: a lone surrogate, which JSON can carry (``"\\ud800"``)
    and a terminal's undecodable bytes become (``surrogateescape``; ``escaped_bytes``: name those
    as the bytes they were, :func:`where_not_utf8`); the tokenizer takes only UTF-8.

    Raises:
        InvalidRequestError: ``text`` holds a code point UTF-8 cannot encode (names ``param``).
    """
    where = where_not_utf8(text, escaped_bytes)
    if where is not None:
        raise InvalidRequestError(f"{what} is not valid UTF-8 text ({where})", param)


def json_kind(value: object) -> str:
    """A decoded JSON value's kind as a message names it: ``an object``, ``an array``, ``a string``,
    ``a number``, ``a boolean``, ``null`` (another Python type: its name)."""
    if value is None:
        return "null"
    for kind, name in ((bool, "a boolean"), (str, "a string"), ((int, float), "a number"), (list, "an array"),
                       (dict, "an object")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def require_file_name(path: object, flag: str, hint: str = "") -> None:
    """Refuse an empty file name given to ``flag`` (``-f ''``, ``--json-schema @``): an empty path
    would be read as the current folder ("Is a directory") or not found with no name to show.

    Raises:
        InvalidRequestError: ``<flag>: the file name is missing<hint>``, param the flag's field name."""
    if path == "":
        raise InvalidRequestError(f"{flag}: the file name is missing{hint}", flag.split("/")[-1].lstrip("-").replace("-", "_"))
