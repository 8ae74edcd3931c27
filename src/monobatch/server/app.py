"""The app factory: one FastAPI app per server, used by ``monobatch serve`` and by in-process
callers (``run``/``chat``, tests) alike.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/tokenize``,
``/detokenize`` (all behind ``--api-key`` when set), ``/health`` and ``/metrics`` (open).
Handlers only parse, tokenize, submit and shape: decoding happens on the engine thread.
"""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from monobatch import __version__
from monobatch.engine.scheduler import BatchScheduler
from monobatch.errors import InvalidRequestError
from monobatch.server import chat, completions
from monobatch.server.chat import render_chat
from monobatch.server.errors import error_body, install_handlers
from monobatch.server.generation import created, token_text
from monobatch.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from monobatch.server.state import ServerSettings, ServerState

#: Path prefixes that need the API key (when one is set).
_PROTECTED = ("/v1/", "/tokenize", "/detokenize")


class Gate:
    """ASGI middleware run before routing: 413 for an oversized body (by Content-Length), 401
    for a missing or wrong Bearer key on protected paths."""

    def __init__(self, app, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or ())
            refusal = self._refusal(scope["path"], headers)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, path: str, headers: dict[bytes, bytes]) -> Response | None:
        key = self.settings.api_key
        if key is not None and path.startswith(_PROTECTED):
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                return JSONResponse(error_body(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                                               code="invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.settings.max_body_bytes:
            return JSONResponse(error_body(413, f"the request body is {int(length)} bytes; the limit is "
                                                f"{self.settings.max_body_bytes}", code="request_too_large"),
                                status_code=413)
        return None


def create_app(settings: ServerSettings, load: Callable[[], BatchScheduler]) -> FastAPI:
    """Build the server app.

    Args:
        settings: server options (names, API key, queue limit, reasoning format, sampling flags).
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

    app = FastAPI(title="monobatch", version=__version__, lifespan=lifespan)
    app.state.monobatch = state
    app.add_middleware(Gate, settings=settings)
    install_handlers(app)

    @app.post("/v1/completions")
    async def post_completions(body: CompletionRequest, request: Request) -> Response:
        return await completions.create_completion(body, request, state)

    @app.post("/v1/chat/completions")
    async def post_chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create_chat_completion(body, request, state)

    @app.get("/v1/models")
    async def get_models() -> dict:
        state.require_client()
        return {"object": "list", "data": [_model_card(state, name) for name in state.names]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        state.require_client()
        return _model_card(state, state.check_model(model_id))

    @app.get("/health")
    async def health() -> Response:
        state.require_client()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        state.require_client()
        state.check_model(body.model)
        tok = state.tokenizer
        add_special = body.add_special_tokens if body.add_special_tokens is not None else body.add_special
        if body.messages is not None:
            chat_body = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt,
                                              chat_template_kwargs=body.chat_template_kwargs)
            _, ids = render_chat(tok, chat_body)  # the ids a chat request would get
        else:
            text = body.prompt if body.prompt is not None else body.content
            ids = tok.encode(text, add_special_tokens=True if add_special is None else add_special)
        out = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        if body.with_pieces:
            out["tokens"] = [{"id": t, "piece": token_text(tok, t)} for t in ids]
        if body.return_token_strs:
            out["token_strs"] = [token_text(tok, t) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        state.require_client()
        state.check_model(body.model)
        tok = state.tokenizer
        if any(not 0 <= t < tok.vocab_size for t in body.tokens):
            raise InvalidRequestError(f"tokens: ids must be in [0, {tok.vocab_size})", "tokens")
        text = tok.decode(body.tokens, skip_special_tokens=False)
        return {"prompt": text, "content": text}

    return app


def _model_card(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": created(), "owned_by": "monobatch",
            "root": str(state.scheduler.engine.loaded.path), "max_model_len": state.max_model_len}
