"""The HTTP side of ``monobatch run`` and ``chat``: a small OpenAI-compatible chat client.

It posts to ``/v1/chat/completions`` with ``stream: true`` and reads the server-sent events with
httpx. It holds no decode logic: every character it yields is one the server sent. Any failure
(nothing listening, a timeout, an error body, a stream cut short) becomes a :class:`ClientError`
whose message is one line for the user.

The pieces other HTTP clients of an OpenAI-compatible server share (``monobatch bench``'s http
path, ``monobatch bench-serve``) are public here: :func:`transport_errors` (httpx's errors as
one line), :func:`refusal` and :func:`error_from_body` (an error answer as one line),
:func:`sse_data` (one line of an event stream) and :func:`aiter_sse` (an httpx stream's events).
"""

from __future__ import annotations

import contextlib

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator

from monobatch.cli.serve import API_KEY_ENV
from monobatch.errors import InvalidRequestError, MonobatchError

if TYPE_CHECKING:  # httpx is imported where a request is made: every command imports this module
    # (through the CLI's command modules), `generate` and `bench` send no request, and httpx with
    # rich, click and pygments (installed for its own command line) is ~9 MiB resident (issue 17)
    import httpx

#: Seconds to wait for a TCP connection (the server is local or should answer at once).
CONNECT_TIMEOUT = 10.0
#: Seconds a stream may stay silent before giving up (a long prompt prefills on CPU before the
#: first byte; Ctrl-C ends the wait sooner).
READ_TIMEOUT = 600.0
#: Seconds between ``/health`` polls while a server loads its model.
HEALTH_POLL = 0.2


class ClientError(MonobatchError):
    """The server could not be reached or refused a request.

    Attributes:
        status: the HTTP status, when the server answered.
        code: the error's ``code`` field (``context_length_exceeded``, ...), if any.
        param: the request field at fault, if any (the CLI names its flag).
    """

    def __init__(self, message: str, status: int | None = None, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(" ".join(message.split()))  # one line, whatever the server sent
        self.status, self.code, self.param = status, code, param


@dataclass(slots=True)
class ChatChunk:
    """What one SSE event of a chat stream carries (first choice only; ``n`` is always 1 here)."""

    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None


class ChatClient:
    """A chat client of one OpenAI-compatible server.

    Args:
        base_url: ``http://host:port`` (a trailing ``/v1`` is accepted and dropped).
        api_key: sent as ``Authorization: Bearer KEY`` when given.
        trust_env: honour proxy environment variables (off for the in-process loopback server).
        read_timeout: seconds a response may stay silent.
        url_flag: the flag that gave ``base_url``, named when it is not a usable URL.
    """

    def __init__(self, base_url: str, api_key: str | None = None, trust_env: bool = True,
                 read_timeout: float = READ_TIMEOUT, url_flag: str = "--server-base") -> None:
        import httpx

        self.base_url = base_root(base_url)
        timeout = httpx.Timeout(read_timeout, connect=CONNECT_TIMEOUT)
        self._http = httpx.Client(base_url=self.base_url, headers=auth_headers(api_key), timeout=timeout,
                                  trust_env=trust_env)
        self._has_key = bool(api_key)
        self._read_timeout, self._url_flag = read_timeout, url_flag

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def wait_healthy(self, timeout: float | None = None, on_wait=None) -> None:
        """Return once ``GET /health`` answers 200; poll while it answers 503 for a model loading.

        A 503 whose error ``code`` is ``model_loading`` (or a 503 without a JSON error body, as
        other servers send) means still loading; any other code (``engine_stopped``,
        ``server_shutting_down``) means it never will be healthy, and raises. A server without
        ``/health`` (another status) is taken as up: the first request tells.

        Args:
            timeout: seconds to wait for the model to load (None = no limit).
            on_wait: called once, with no arguments, when the server is still loading.

        Raises:
            ClientError: nothing listens, a 503 that is not loading (the server's message), or
                still loading after ``timeout``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        waited = False
        while True:
            with self._errors():
                r = self._http.get("/health")
            if r.status_code != 503:
                return
            code = _error_code(r)
            if code is not None and code != "model_loading":
                raise self._refusal(r)
            if not waited and on_wait is not None:
                on_wait()
            waited = True
            if deadline is not None and time.monotonic() > deadline:
                raise ClientError(f"the server at {self.base_url} is still loading its model after {timeout:g} s")
            time.sleep(HEALTH_POLL)

    def model_id(self) -> str | None:
        """The first model ``GET /v1/models`` lists (None when it lists none).

        Raises:
            ClientError: unreachable, or an error answer (a wrong API key: 401).
        """
        with self._errors():
            r = self._http.get("/v1/models")
        if r.status_code >= 400:
            raise self._refusal(r)
        try:
            data = r.json().get("data") or []
            return data[0]["id"] if data else None
        except (ValueError, AttributeError, KeyError, TypeError):
            raise ClientError(f"{self.base_url}/v1/models did not answer an OpenAI model list") from None

    def count_tokens(self, model: str, text: str) -> int | None:
        """Tokens ``text`` makes on the server (``POST /tokenize``, as llama-server, vLLM and
        monobatch answer it; no special tokens); None when the server cannot tell."""
        import httpx

        try:
            r = self._http.post("/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
            count = r.json().get("count") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return count if isinstance(count, int) and count > 0 else None

    def stream_chat(self, body: dict[str, Any]) -> Iterator[ChatChunk]:
        """POST ``body`` (which must ask for ``stream: true``) and yield its chunks until ``[DONE]``.

        Closing the generator early (Ctrl-C, ``close()``) closes the connection, which makes the
        server abort the request.

        Raises:
            ClientError: unreachable, an error answer, an error event, a stream cut short.
        """
        with self._errors(), self._http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code >= 400:
                r.read()
                raise self._refusal(r)
            for line in r.iter_lines():
                payload = sse_data(line)
                if payload is SSE_DONE:
                    return
                if payload is not None:
                    yield _chunk(payload)
            raise stream_cut_short(self.base_url)

    def _refusal(self, r: httpx.Response) -> ClientError:
        """:func:`refusal` of an error response from this server."""
        return refusal(r, self.base_url, self._has_key)

    def _errors(self):
        """:func:`transport_errors` for this server."""
        return transport_errors(self.base_url, self._read_timeout, self._url_flag)


def check_base_url(base_url: str, flag: str) -> None:
    """Refuse a server URL no request could use, before any is sent: not ``http://`` or
    ``https://``, malformed (``http://[::1``), no host, a host name no resolver takes
    (``http://ex_ample..com``: an empty label), a port outside 1..65535.

    Args:
        flag: the flag that gave it (``--server-base``, ``--base-url``), named in the message.

    Raises:
        InvalidRequestError: one line naming ``flag`` and the URL.
    """
    import httpx

    param = flag.lstrip("-").replace("-", "_")
    if not base_url.startswith(("http://", "https://")):
        raise InvalidRequestError(f"{flag} must be an http:// or https:// URL, got {base_url!r}", param)
    try:
        url = httpx.URL(base_url)
        url.host  # noqa: B018 - decodes an IDNA name as httpx does when it sends (xn--a: UnicodeError)
    except (httpx.InvalidURL, UnicodeError) as exc:  # a malformed port or IPv6 address, a bad IDNA name
        why: str | None = str(exc)
    else:
        host, why = url.raw_host.decode("ascii"), None  # IDNA-encoded, as the connection resolves it
        if not host:
            why = "no host"
        elif not _resolvable(host):
            why = f"the host name {host!r} has an empty or overlong label"
        elif url.port is not None and not 1 <= url.port <= 65535:
            why = f"port {url.port} is not in 1..65535"
    if why is not None:
        raise InvalidRequestError(unusable_url(flag, base_url, why), param)


def _resolvable(host: str) -> bool:
    """Whether the resolver takes ``host`` (socket's encoding of a name: no empty label, none over
    63 characters; ``ex_ample..com`` raised UnicodeError deep in the connection)."""
    try:
        host.encode("idna")
    except UnicodeError:
        return False
    return True


def unusable_url(flag: str, base_url: str, why: str) -> str:
    """The one line for a server URL that cannot be used: ``--server-base: not a usable http(s) URL:
    'http://[::1' (Invalid port: ':1')``."""
    return f"{flag}: not a usable http(s) URL: {base_url!r} ({why})"


def base_root(base_url: str) -> str:
    """``base_url`` without a trailing ``/`` or ``/v1``."""
    base = base_url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def auth_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer KEY`` when a key is given."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@contextmanager
def transport_errors(base_url: str, read_timeout: float = READ_TIMEOUT,
                     url_flag: str = "--server-base") -> Iterator[None]:
    """Turn httpx's transport errors inside the block into one-line ClientErrors.

    Args:
        base_url: the server, as the messages name it.
        read_timeout: the read timeout in use (named when it expires).
        url_flag: the flag that gave ``base_url`` (named when it is not a usable URL).
    """
    import httpx

    try:
        yield
    except httpx.ConnectTimeout:
        raise ClientError(f"cannot connect to the server at {base_url}: timed out") from None
    except httpx.ConnectError as exc:
        reason = str(exc).split("] ", 1)[-1] or "connection failed"  # "[Errno 111] Connection refused"
        raise ClientError(f"cannot connect to the server at {base_url}: {reason}") from None
    except httpx.ReadTimeout:
        raise ClientError(f"the server at {base_url} sent nothing for {read_timeout:g} s") from None
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        raise ClientError(f"the connection to {base_url} broke: {exc or type(exc).__name__}") from None
    except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
        raise ClientError(unusable_url(url_flag, base_url, str(exc))) from None
    except httpx.HTTPError as exc:
        raise ClientError(f"HTTP error talking to {base_url}: {exc or type(exc).__name__}") from None


def refusal(r: httpx.Response, base_url: str, has_key: bool) -> ClientError:
    """A ClientError from an error response (OpenAI's ``{"error": {...}}`` or anything else; a
    401 says whether a key was sent). The body must have been read."""
    if r.status_code == 401:
        if has_key:
            return ClientError(f"the server at {base_url} refused the API key (HTTP 401)", 401)
        return ClientError(f"the server at {base_url} needs an API key: pass --api-key KEY or set "
                           f"${API_KEY_ENV}", 401)
    try:
        body = r.json()
    except ValueError:
        body = None
    return error_from_body(body, r.status_code, r.text)


#: What :func:`sse_data` returns for ``data: [DONE]``, the end of an OpenAI stream.
SSE_DONE: Any = object()


def sse_data(line: str) -> dict[str, Any] | None:
    """One line of an OpenAI-compatible event stream.

    Returns:
        The JSON object of a ``data:`` line; :data:`SSE_DONE` for ``data: [DONE]``; None for a
        line that carries no data (blank separators, ``: keep-alive`` comments, event names).

    Raises:
        ClientError: an error event (``data: {"error": ...}``, or llama.cpp's ``error: {...}``
            line), or data that is not a JSON object.
    """
    if line.startswith("error:"):  # llama.cpp's error line in the middle of a stream
        raise _error_line(line[6:].strip())
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return SSE_DONE
    try:
        payload = json.loads(data)
    except ValueError:
        raise ClientError(f"the server sent an event that is not JSON: {data[:80]!r}") from None
    if not isinstance(payload, dict):
        raise ClientError(f"the server sent an unexpected event: {data[:80]!r}")
    if "error" in payload:
        raise error_from_body(payload, None)
    return payload


async def aiter_sse(response: httpx.Response, base_url: str) -> AsyncIterator[dict[str, Any]]:
    """The events (:func:`sse_data`'s objects) of a streamed httpx response, until ``[DONE]``.

    Raises:
        ClientError: an error event, a malformed one, or the stream ending before ``[DONE]``.
    """
    async with contextlib.aclosing(response.aiter_lines()) as lines:  # closed at [DONE] too, not left to GC
        async for line in lines:
            payload = sse_data(line)
            if payload is SSE_DONE:
                return
            if payload is not None:
                yield payload
    raise stream_cut_short(base_url)


def stream_cut_short(base_url: str) -> ClientError:
    """The stream ended without ``[DONE]``."""
    return ClientError(f"the server at {base_url} closed the stream before the reply ended")


def _chunk(payload: dict[str, Any]) -> ChatChunk:
    """One event of a chat stream as a ChatChunk."""
    data = json.dumps(payload)
    usage, choices = payload.get("usage"), payload.get("choices") or []
    if not isinstance(usage, (dict, type(None))) or not isinstance(choices, list):
        raise _malformed(data)
    out = ChatChunk(usage=usage)
    for choice in choices:
        if not isinstance(choice, dict):
            raise _malformed(data)
        if choice.get("index", 0) != 0:
            continue
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict):
            raise _malformed(data)
        content, reasoning = delta.get("content") or "", delta.get("reasoning_content") or ""
        finish_reason = choice.get("finish_reason")
        if not isinstance(content, str) or not isinstance(reasoning, str) \
                or not isinstance(finish_reason, (str, type(None))):
            raise _malformed(data)
        out.content, out.reasoning, out.finish_reason = content, reasoning, finish_reason
    return out


def _malformed(data: str) -> ClientError:
    """A chat chunk whose fields do not have OpenAI's shape."""
    return ClientError(f"the server sent a malformed chat chunk: {data[:120]!r}")


def _error_line(data: str) -> ClientError:
    """llama.cpp's ``error: {...}`` stream line (the error object, or ``{"error": {...}}``)."""
    try:
        payload = json.loads(data)
    except ValueError:
        payload = None
    if isinstance(payload, dict) and "error" not in payload:
        payload = {"error": payload}
    return error_from_body(payload, None, data)


def _error_code(r: httpx.Response) -> str | None:
    """The ``code`` of an OpenAI-shaped error body (None without one: not JSON, no code)."""
    try:
        body = r.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def error_from_body(body: Any, status: int | None, text: str = "") -> ClientError:
    """A one-line ClientError from an error answer's body (OpenAI's ``{"error": {...}}``, a
    string error, FastAPI's ``detail``, or ``text`` as sent); ``status`` None: an error event in
    the middle of a stream."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        message, code, param = str(error.get("message") or "no message"), error.get("code"), error.get("param")
    elif isinstance(error, str):  # some servers send {"error": "..."}
        message, code, param = error, None, None
    elif isinstance(body, dict) and "detail" in body:  # FastAPI's default shape
        message, code, param = str(body["detail"]), None, None
    else:
        message, code, param = (text.strip()[:200] or "no message"), None, None
    if status is None:  # an error event in the middle of a stream
        message = f"the server failed during the reply: {message}"
    elif status != 400:
        message = f"the server answered HTTP {status}: {message}"
    return ClientError(message, status, code, param if isinstance(param, str) else None)
