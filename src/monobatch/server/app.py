"""The app factory: one FastAPI app per server, used by ``monobatch serve`` and by in-process
callers (``run``/``chat``, tests) alike.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/tokenize``,
``/detokenize`` and the API docs (``/docs``, ``/redoc``, ``/openapi.json``) — all behind
``--api-key`` when set — and ``/health`` and ``/metrics`` (open). Handlers only parse, tokenize
(off the event loop), submit and shape: decoding happens on the engine thread. Each route
declares what it answers (``responses=``, :mod:`monobatch.server.openapi`), so ``/openapi.json``
describes the server as it is.
"""

from __future__ import annotations

import hmac
import time
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Path, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from monobatch import __version__
from monobatch.engine.scheduler import BatchScheduler
from monobatch.server import chat, completions
from monobatch.server.chat import chat_prompt_ids, message_chars
from monobatch.server.errors import APIError, error_body, install_handlers, log_error_response
from monobatch.server.generation import check_prompt_chars, created, off_loop
from monobatch.server.openapi import PROTECTED_PREFIXES, install_openapi, route_responses
from monobatch.server.protocol import (MODEL_MARKER, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       TokenizeRequest)
from monobatch.server.state import ServerSettings, ServerState
from monobatch.tokenizer import Tokenizer

#: Path prefixes that need the API key (when one is set).
_PROTECTED = PROTECTED_PREFIXES


class Gate:
    """ASGI middleware run before routing: 401 for a missing or wrong Bearer key on protected
    paths, 413 for an oversized body — by its Content-Length before reading it, or counted while
    a chunked body (no Content-Length) arrives. Also stamps the request's arrival time
    (``request.state.arrival_time``, ``time.perf_counter``: TTFT and e2e latency start there)."""

    def __init__(self, app, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings
        self._key = None if settings.api_key is None else settings.api_key.encode("ascii")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["arrival_time"] = time.perf_counter()
        headers = dict(scope.get("headers") or ())
        refusal = self._refusal(scope["path"], headers)
        if refusal is None and b"content-length" not in headers and scope["method"] in ("POST", "PUT", "PATCH"):
            receive, refusal = await self._read_limited(receive)
        if refusal is not None:
            status, message, code, extra = refusal
            log_error_response(scope["method"], scope["path"], status, message)
            await JSONResponse(error_body(status, message, code=code), status_code=status, headers=extra)(
                scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, path: str, headers: dict[bytes, bytes]) -> tuple | None:
        """(status, message, code, headers) of a refusal, or None."""
        if self._key is not None and path.startswith(_PROTECTED):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                return (401, "invalid or missing API key (send Authorization: Bearer <key>)", "invalid_api_key",
                        {"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.settings.max_body_bytes:
            return self._too_large(f"the request body is {int(length)} bytes")
        return None

    def _too_large(self, what: str) -> tuple:
        return 413, f"{what}; the limit is {self.settings.max_body_bytes}", "request_too_large", None

    async def _read_limited(self, receive):
        """Read a body of unknown length up to the limit; returns a ``receive`` that replays it
        (then the connection's own, for the disconnect), or a 413 (as :meth:`_refusal`)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                first = message
                break
            size += len(message.get("body", b""))
            if size > self.settings.max_body_bytes:
                return receive, self._too_large(f"the request body is over {self.settings.max_body_bytes} bytes")
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        return replay, None


_DESCRIPTION = """OpenAI-compatible API of the monobatch engine, with the sampling extensions of llama.cpp
and vLLM (reference: docs/server-api.md).

- Request bodies are JSON objects; a field not listed is a 400, `null` means absent.
- Every error is `{"error": {"message", "type", "param", "code"}}` (ErrorResponse) with a 4xx
  status, 500 only for a bug or an engine failure; a validation error is a 400, never a 422.
- Value ranges in the request schemas are the ones the engine checks.
"""


def create_app(settings: ServerSettings, load: Callable[[], BatchScheduler]) -> FastAPI:
    """Build the server app.

    Args:
        settings: server options (names, API key, queue limit, reasoning format, sampling flags,
            CORS origins).
        load: builds the BatchScheduler; called on a background thread once the app starts, so
            the server can listen (``/health`` 503) while the model loads. Pass
            ``lambda: scheduler`` to serve an engine that is already built.

    Returns:
        The app; ``app.state.monobatch`` is its :class:`ServerState`.
    """
    state = ServerState(settings, load)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start_loading()
        yield
        state.shutdown()

    # redirect_slashes off: a path with a trailing slash is not a route (an OpenAI-shaped 404), never
    # a 307 with an empty body (clients do not follow a redirect of a POST's body)
    app = FastAPI(title="monobatch", version=__version__, lifespan=lifespan, description=_DESCRIPTION,
                  redirect_slashes=False)
    app.state.monobatch = state
    app.add_middleware(Gate, settings=settings)
    if settings.allowed_origins:  # outermost: a preflight (no key) is answered before the Gate
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_credentials=False,
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])
    install_handlers(app)
    install_openapi(app, settings, state)

    def doc(route: str) -> dict:
        """The OpenAPI keywords of one route: no inferred response model, its real responses."""
        return {"response_model": None, "responses": route_responses(route, settings)}

    @app.post("/v1/completions", summary="Complete a prompt (text or token ids), streamed or not", **doc("completions"))
    async def post_completions(body: CompletionRequest, request: Request) -> Response:
        return await completions.create_completion(body, request, state)

    @app.post("/v1/chat/completions", summary="Answer a conversation, streamed or not", **doc("chat"))
    async def post_chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create_chat_completion(body, request, state)

    @app.get("/v1/models", summary="The served model names", **doc("models"))
    async def get_models() -> dict:
        state.require_client()
        return {"object": "list", "data": [_model_card(state, name) for name in state.names]}

    @app.get("/v1/models/{model_id:path}", summary="One served model", **doc("model"))
    async def get_model(model_id: str = Path(json_schema_extra={"x-monobatch": MODEL_MARKER})) -> dict:
        state.require_client()
        if not model_id:  # `/v1/models/`: no id (check_model reads an empty request field as the default)
            raise APIError(404, "GET /v1/models/: no model id; GET /v1/models lists the served models",
                           param="model", code="model_not_found")
        return _model_card(state, state.check_model(model_id))

    @app.get("/health", summary="200 once the model is loaded and the engine runs (open)", **doc("health"))
    async def health() -> Response:
        state.require_client()
        return JSONResponse({"status": "ok"})

    @app.head("/health", include_in_schema=False)  # load balancers that probe with HEAD: GET's status, no body
    async def health_head() -> Response:
        state.require_client()
        return Response(status_code=200)

    @app.get("/metrics", summary="Prometheus metrics (open)", response_class=PlainTextResponse, **doc("metrics"))
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", summary="Text or messages to token ids", **doc("tokenize"))
    async def tokenize(body: TokenizeRequest) -> dict:
        state.require_client()
        state.check_model(body.model)
        tok = state.tokenizer
        if body.messages is not None:  # the ids a chat request would get
            check_prompt_chars(message_chars(body.messages), state.max_prompt_chars, state.max_model_len, "messages")
            ids = await off_loop(chat_prompt_ids, tok, body.messages, body.add_generation_prompt,
                                 body.chat_template_kwargs, body.tools, body.tool_choice, body.parallel_tool_calls)
        else:
            text, param = (body.prompt, "prompt") if body.prompt is not None else (body.content, "content")
            check_prompt_chars(len(text), state.max_prompt_chars, state.max_model_len, param)
            ids = await off_loop(tok.encode, text, add_special_tokens=body.add_specials)
        out = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        if body.with_pieces:
            out["tokens"] = [{"id": t, "piece": _piece(tok, t)} for t in ids]
        if body.return_token_strs:
            out["token_strs"] = [tok.token_bytes(t).decode("utf-8", errors="replace") for t in ids]
        return out

    @app.post("/detokenize", summary="Token ids to text", **doc("detokenize"))
    async def detokenize(body: DetokenizeRequest) -> dict:
        state.require_client()
        state.check_model(body.model)
        text = await off_loop(state.tokenizer.decode, body.tokens, skip_special_tokens=False)
        return {"prompt": text, "content": text}

    return app


def _piece(tok: Tokenizer, token_id: int) -> str | list[int]:
    """llama.cpp's ``piece``: the token's text, or its bytes when they are not valid UTF-8 alone."""
    raw = tok.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _model_card(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": created(), "owned_by": "monobatch",
            "root": str(state.scheduler.engine.loaded.path), "max_model_len": state.max_model_len}
