"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.

Every client mistake ends here as a 400/401/404/413/429 (503 while the model loads); only a bug
or an engine failure is a 500. Handlers are registered on the app by :func:`install_handlers`.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from monobatch.errors import ContextLengthError, MonobatchError, json_kind

log = logging.getLogger("monobatch.server")

#: OpenAI's error ``type`` per status.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """An error answered as OpenAI-shaped JSON.

    Args:
        status: the HTTP status.
        message: one line for the user.
        param: the request field at fault, if any.
        code: a machine-readable code (``context_length_exceeded``, ``model_not_found``, ...).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The JSON body of an error response (also sent as an SSE event when a stream fails)."""
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """An OpenAI-shaped JSON error response."""
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


#: Most characters of an error message a log line carries: a message may quote the client's text
#: (``Tokenizer``'s "the text ... cannot be tokenized" quotes a message's content), as long as the
#: body; the client gets the whole message, the log a bounded line.
LOGGED_MESSAGE_CHARS = 300


def log_error_response(method: str, path: str, status: int, message: str) -> None:
    """The one log line of a request answered with an error status before it ran (a 4xx, a 503
    while loading or shutting down): INFO, its status and message, no traceback (a client's mistake
    or the server's state, not a bug: those are logged with their traceback, ``_bug``). The message
    is kept to one line (line breaks escaped) of at most :data:`LOGGED_MESSAGE_CHARS` characters.
    ``/health``'s 503 (loading, shutting down) is logged at DEBUG: a load balancer polls it, and
    the answer is the server's state, which the start-up and shutdown lines already say."""
    level = logging.DEBUG if path == "/health" and status == 503 else logging.INFO
    line = message.replace("\r", "\\r").replace("\n", "\\n")
    if len(line) > LOGGED_MESSAGE_CHARS:
        line = line[:LOGGED_MESSAGE_CHARS] + f"... ({len(message)} characters)"
    log.log(level, "%s %s %d: %s", method, path, status, line)


def from_monobatch(exc: MonobatchError) -> APIError:
    """A MonobatchError raised on a request's behalf (bad field, prompt too long) as a 400."""
    code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
    return APIError(400, str(exc), getattr(exc, "param", None), code)


def _path(loc: list) -> str:
    """pydantic's ``loc`` as the request's path: fields joined by dots, list indices in brackets
    (``messages[0]``, as OpenAI names an element and as the chat checks do)."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


#: pydantic's names of a union's members in an error's ``loc`` (``stop.str``, ``stop.list[str]``)
_MEMBER_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "bytes", "none"})


def _field_loc(loc: tuple | list) -> list:
    """An error's ``loc`` as the request's path: without FastAPI's ``body`` and pydantic's union
    member names (``('stop', 'list[str]', 0)`` -> ``['stop', 0]``)."""
    return [p for p in loc if p != "body" and not (isinstance(p, str) and (p in _MEMBER_NAMES or "[" in p))]


def validation_message(errors: list[dict], content_type: str | None = None) -> tuple[str, str | None]:
    """pydantic's errors as one line and the field at fault, named by its whole path as OpenAI's
    ``param`` does (``response_format.json_schema.name``, ``messages[0].content``).

    A union field fails once per member (``prompt``: not a string, not a list, ...): those of
    different kinds are joined under the field's name; where one member's error lies deeper (a
    list whose element is wrong: ``stop: [null]``), that one is given. ``content_type``: the
    request's header, named in the message when a body that is not an object came with another
    type than JSON (curl's ``-d`` without ``-H 'Content-Type: application/json'`` sends a form,
    which is not read as JSON). A list (or object) of the wrong length reads as the range errors
    do: ``messages: must have at least 1 item, got 0``.
    """
    first = errors[0]
    raw = _field_loc(first.get("loc", ()))
    kind, loc = first.get("type"), [str(p) for p in raw]
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    if kind == "missing" and not loc:
        return "the request body is empty: expected a JSON object", None
    if kind in ("model_attributes_type", "model_type") and not loc:  # the body itself; a field's: below
        media = (content_type or "").split(";")[0].strip().lower()
        if media != "application/json":
            sent = f"Content-Type {media!r}" if media else "no Content-Type"
            return (f"the request came with {sent}: send the JSON body with the header Content-Type: "
                    "application/json (curl: -H 'Content-Type: application/json')"), None
        return "the request body must be a JSON object", None
    ctx = first.get("ctx") or {}
    if "field" in ctx:  # our own PydanticCustomErrors carry the field and a finished message
        return first["msg"], ctx["field"]
    if kind == "extra_forbidden":
        return f"{_path(raw)}: unknown field (not supported by monobatch)", _path(raw) or None
    same = [e for e in errors if [str(p) for p in _field_loc(e.get("loc", ()))][:1] == loc[:1]]
    # the member that got furthest: the longest path, then the latest list index (a token-id list
    # [1, "a"] fails the string list at [0] and the id list at [1]: its error is the id list's)
    deepest = max(same, key=lambda e: (len(_field_loc(e.get("loc", ()))),
                                       [p for p in _field_loc(e.get("loc", ())) if isinstance(p, int)]))
    if len(_field_loc(deepest.get("loc", ()))) > len(raw):  # a union member that got further: its error
        first, raw = deepest, _field_loc(deepest.get("loc", ()))
    elif len(same) > 1 and len({e["type"] for e in same}) > 1:  # a union: every member failed at the field
        return f"{_path(raw)}: invalid value ({'; '.join(dict.fromkeys(e['msg'] for e in same))})", _path(raw)
    if first.get("type") in ("model_type", "model_attributes_type", "dict_type"):  # not the class's name
        return f"{_path(raw)}: must be a JSON object, got {json_kind(first.get('input'))}", _path(raw)
    ctx = first.get("ctx") or {}
    if first.get("type") in ("too_short", "too_long") and "actual_length" in ctx:  # a list's length, as the range errors read
        bound, n = ("at least", ctx.get("min_length")) if first["type"] == "too_short" else ("at most", ctx.get("max_length"))
        return f"{_path(raw)}: must have {bound} {n} item{'' if n == 1 else 's'}, got {ctx['actual_length']}", _path(raw)
    return f"{_path(raw)}: {first['msg']}", _path(raw) or None


#: FastAPI's 400 detail where decoding the JSON body raised something else than a JSONDecodeError
_FASTAPI_PARSE_ERROR = "There was an error parsing the body"


def body_parse_message(body: bytes) -> str:
    """Why a request body that FastAPI could not parse is not JSON, in the words of the other
    body errors: bytes that are not UTF-8 (``json.loads`` raises UnicodeDecodeError) or nesting
    deeper than the parser's recursion limit (RecursionError)."""
    try:
        json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as e:
        return (f"the request body is not valid UTF-8 (byte 0x{body[e.start]:02x} at offset {e.start}): "
                "send JSON text encoded as UTF-8")
    except RecursionError:
        return "the request body is not valid JSON: nested too deeply (arrays or objects thousands of levels deep)"
    except ValueError as e:
        return f"the request body is not valid JSON: {e}"
    return "the request body could not be parsed as JSON"


def install_handlers(app: FastAPI) -> None:
    """Map APIError, MonobatchError, validation and routing errors to OpenAI-shaped responses,
    each logged as one line (:func:`log_error_response`)."""

    def answer(request: Request, status: int, message: str, param: str | None = None, code: str | None = None,
               headers: dict[str, str] | None = None) -> JSONResponse:
        log_error_response(request.method, request.url.path, status, message)
        return error_response(status, message, param, code, headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return answer(request, exc.status, exc.message, exc.param, exc.code, headers)

    @app.exception_handler(MonobatchError)
    async def _monobatch_error(request: Request, exc: MonobatchError) -> JSONResponse:
        err = from_monobatch(exc)
        return answer(request, err.status, err.message, err.param, err.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()), request.headers.get("content-type"))
        return answer(request, 400, message, param)

    @app.exception_handler(ValidationError)
    async def _model_error(request: Request, exc: ValidationError) -> JSONResponse:
        # a model built inside a handler from client input: still the client's 400, never a 500
        message, param = validation_message(list(exc.errors()))
        return answer(request, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == _FASTAPI_PARSE_ERROR:  # json.loads raised other than JSONDecodeError
            return answer(request, 400, body_parse_message(await request.body()))
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return answer(request, exc.status_code, message, None, None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
