"""The server's OpenAPI document (``/openapi.json``, rendered by ``/docs`` and ``/redoc``).

FastAPI and pydantic generate it from the routes and the request models of
:mod:`monobatch.server.protocol`; this module adds what they cannot know:

- the **responses** each route really sends (:func:`route_responses`): the 200 body (pydantic
  models below, for documentation only: handlers build plain dicts), ``text/event-stream`` as the
  streamed alternative of the generation endpoints (one schema per event: a chunk, an error, or
  ``[DONE]``), ``text/plain`` for ``/metrics``, and every error status with one OpenAI-shaped
  error schema (:class:`ErrorResponse`). 401 is listed only with ``--api-key``, 429 only with
  ``--max-queue``: without them the server never sends them.
- in :func:`install_openapi` (the ``app.openapi`` override): no 422 (validation errors are 400s,
  errors.py), the Bearer security scheme with ``--api-key``, the SSE chunk schemas as components,
  and, once the model is loaded, this server's values: the served model names (``model`` enum)
  and the vocabulary (``maximum`` of every token id).

``tests/test_openapi.py`` runs schemathesis against a real server with this document and fails on
any 5xx or any response it does not describe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from monobatch.server.protocol import MODEL_MARKER, PROMPT_TEXT_MARKER, TOKEN_ID_MARKER

if TYPE_CHECKING:
    from fastapi import FastAPI

    from monobatch.server.state import ServerSettings, ServerState

#: Path prefixes behind ``--api-key`` (the Gate's list in app.py).
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/docs", "/redoc", "/openapi.json")
_COMPONENTS = "#/components/schemas/"


# -- response bodies (documentation only) -----------------------------------------------------------
class _Doc(BaseModel):
    """A documented response body: unknown keys are allowed (clients must ignore them)."""

    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Doc):
    """OpenAI's error object."""

    message: str = Field(description="One line for the user.")
    type: Literal["invalid_request_error", "authentication_error", "not_found_error", "rate_limit_error",
                  "server_error", "service_unavailable_error"]
    param: str | None = Field(description="The request field at fault, if any.")
    code: str | None = Field(description="context_length_exceeded, invalid_api_key, model_not_found, "
                                         "request_too_large, rate_limit_exceeded, model_loading, "
                                         "server_shutting_down, engine_stopped, or null.")


class ErrorResponse(_Doc):
    """Every error the server sends, whatever the status (also as an SSE event when a stream fails)."""

    error: ErrorDetail


class PromptTokensDetails(_Doc):
    """Prompt tokens adopted from the prefix cache."""

    cached_tokens: int = Field(ge=0)


class Usage(_Doc):
    """Each prompt counted once; ``completion_tokens`` sums every choice."""

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails


FinishReason = Literal["stop", "length", "loop"]
ChatFinishReason = Literal["stop", "length", "loop", "tool_calls"]


class CompletionLogprobs(_Doc):
    """Legacy completions' logprobs: parallel lists, one entry per token (the first echoed prompt
    token has no logprob)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Doc):
    """One choice of a completion."""

    index: int = Field(ge=0, description="prompt index * n + j")
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    token_ids: list[int] | None = Field(None, description="With return_token_ids.")
    prompt_token_ids: list[int] | None = Field(None, description="With return_token_ids.")


class Completion(_Doc):
    """``POST /v1/completions``, not streamed."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(_Doc):
    """One choice's piece in a streamed completion chunk."""

    index: int = Field(ge=0)
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None = Field(description="Set on the choice's last chunk only.")
    token_ids: list[int] | None = Field(None, description="With return_token_ids: the tokens not sent yet.")


class CompletionChunk(_Doc):
    """One ``data:`` event of a streamed completion (``usage``: present with
    ``stream_options.include_usage``, null except on the last chunk, whose choices are empty)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class TopLogprob(_Doc):
    """One alternative of chat logprobs."""

    token: str
    logprob: float
    bytes: list[int]


class ChatLogprob(TopLogprob):
    """One token of chat logprobs."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Doc):
    """Chat's logprobs."""

    content: list[ChatLogprob]


class ToolCallFunction(_Doc):
    """The function a tool call names; ``arguments`` is JSON text, or, in a reply ``max_tokens``
    cut inside the call (finish_reason length), its text as far as it came."""

    name: str
    arguments: str


class ToolCall(_Doc):
    """One tool call of an assistant message."""

    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(_Doc):
    """The assistant's reply (``reasoning_content`` only when the reply had a reasoning block)."""

    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Doc):
    """One choice of a chat completion."""

    index: int = Field(ge=0)
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason
    token_ids: list[int] | None = Field(None, description="With return_token_ids.")


class ChatCompletion(_Doc):
    """``POST /v1/chat/completions``, not streamed."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = Field(None, description="With return_token_ids.")


class ToolCallFunctionDelta(_Doc):
    """A piece of a streamed tool call's function."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Doc):
    """A piece of a streamed tool call (the first carries id and name)."""

    index: int = Field(ge=0)
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunctionDelta | None = None


class ChatDelta(_Doc):
    """What a chunk adds to a choice. The first chunk of each choice has the role: with empty
    content, or, with tools offered, the reply's first piece (content null beside a first tool
    call; a role chunk of its own with content null before reasoning)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Doc):
    """One choice's piece in a streamed chat chunk."""

    index: int = Field(ge=0)
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None = Field(description="Set on the choice's last chunk only.")
    token_ids: list[int] | None = Field(None, description="With return_token_ids: the tokens not sent yet.")
    prompt_token_ids: list[int] | None = Field(None, description="With return_token_ids, on choice 0's role chunk.")


class ChatCompletionChunk(_Doc):
    """One ``data:`` event of a streamed chat completion (``usage`` as in CompletionChunk)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Doc):
    """One served model."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: Literal["monobatch"]
    root: str = Field(description="The model file's path.")
    max_model_len: int = Field(ge=1, description="The context length, in tokens.")


class ModelList(_Doc):
    """``GET /v1/models``: the served names."""

    object: Literal["list"]
    data: list[ModelCard]


class Health(_Doc):
    """``GET /health`` once the model is loaded and the engine runs."""

    status: Literal["ok"]


class TokenPiece(_Doc):
    """llama.cpp's ``with_pieces`` entry: the token's text, or its bytes when they are not valid
    UTF-8 alone."""

    id: int = Field(ge=0)
    piece: str | list[int]


class TokenizeResponse(_Doc):
    """``POST /tokenize``."""

    count: int = Field(ge=0)
    max_model_len: int = Field(ge=1)
    tokens: list[int] | list[TokenPiece] = Field(description="Ids, or [{id, piece}] with with_pieces.")
    token_strs: list[str] | None = Field(None, description="With return_token_strs.")


class DetokenizeResponse(_Doc):
    """``POST /detokenize``: the same text under vLLM's and llama.cpp's key."""

    prompt: str
    content: str


# -- per-route responses ---------------------------------------------------------------------------------
_ERRORS = {
    400: "Invalid request: a wrong JSON type, a value out of range, an unknown or refused field, a body that is not "
         "a JSON object, bad messages, a chat template's raise_exception, token ids outside the vocabulary, too many "
         "sequences (prompts x n); code context_length_exceeded when the prompt leaves no room to generate.",
    401: "The Bearer key is missing or wrong (code invalid_api_key; header WWW-Authenticate: Bearer).",
    404: "The model is not a served name (code model_not_found, param model).",
    413: "The request body is over the limit (code request_too_large), by Content-Length or counted as it arrives.",
    429: "--max-queue is full (code rate_limit_exceeded): retry later.",
    500: "A bug, or an engine step that raised while running this request; never a client mistake.",
    503: "code model_loading (retry when GET /health answers 200), server_shutting_down or engine_stopped.",
}
_ERROR_CONTENT = {"application/json": {"schema": {"$ref": _COMPONENTS + "ErrorResponse"}}}

#: Route -> (200 model, its description, error statuses beyond 401/413/500, streams).
_ROUTES: dict[str, tuple[type[BaseModel] | None, str, tuple[int, ...], bool]] = {
    "completions": (Completion, "The completion; with stream: true, server-sent events (text/event-stream) of "
                                "CompletionChunk, then data: [DONE].", (400, 404, 429, 503), True),
    "chat": (ChatCompletion, "The chat completion; with stream: true, server-sent events (text/event-stream) of "
                             "ChatCompletionChunk, then data: [DONE].", (400, 404, 429, 503), True),
    "models": (ModelList, "The served names.", (503,), False),
    "model": (ModelCard, "The model card; any served name (an empty id: the first).", (404, 503), False),
    "health": (Health, "The model is loaded and the engine runs.", (503,), False),
    "metrics": (None, "Prometheus text exposition format (prometheus_client's CONTENT_TYPE_LATEST); open, also "
                      "while the model loads.", (), False),
    "tokenize": (TokenizeResponse, "The ids (and pieces or strings when asked).", (400, 404, 503), False),
    "detokenize": (DetokenizeResponse, "The text, special tokens kept.", (400, 404, 503), False),
}
_CHUNKS = {"completions": CompletionChunk, "chat": ChatCompletionChunk}


def sse_event_schema(chunk: str) -> dict[str, Any]:
    """The schema of one server-sent event of a stream of ``chunk`` (a component name): its
    ``data`` is a chunk, an error (a failure during generation) or ``[DONE]`` (always last)."""
    return {
        "type": "object",
        "description": f"One event per chunk ({chunk}); a failure during generation sends an ErrorResponse event; "
                       "the stream always ends with data: [DONE].",
        "required": ["data"],
        "properties": {"data": {
            "type": "string",
            "if": {"const": "[DONE]"},
            "else": {"contentMediaType": "application/json",
                     "contentSchema": {"anyOf": [{"$ref": _COMPONENTS + chunk},
                                                 {"$ref": _COMPONENTS + "ErrorResponse"}]}},
        }},
    }


def route_responses(route: str, settings: "ServerSettings") -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of one route (a key of the table above): its 200 and the error
    statuses it really sends with these settings.

    Raises:
        KeyError: an unknown route name.
    """
    model, description, statuses, streams = _ROUTES[route]
    if model is None:  # /metrics: the route's response_class gives the media type
        ok: dict[str, Any] = {"description": description, "content": {"text/plain": {"schema": {"type": "string"}}}}
    else:
        ok = {"model": model, "description": description}
    if streams:
        ok["content"] = {"text/event-stream": {"schema": sse_event_schema(_CHUNKS[route].__name__)}}
    out: dict[int | str, dict[str, Any]] = {200: ok}
    extra = set(statuses) | {413, 500}
    if settings.api_key is not None and route not in ("health", "metrics"):
        extra.add(401)
    if settings.max_queue is None:
        extra.discard(429)
    for status in sorted(extra):
        out[status] = {"description": _ERRORS[status], "content": _ERROR_CONTENT}
        if status == 401:
            out[status]["headers"] = {"WWW-Authenticate": {"schema": {"type": "string", "const": "Bearer"},
                                                           "required": True}}
    return out


# -- the document -----------------------------------------------------------------------------------------
def _without_validation_errors(doc: dict[str, Any]) -> None:
    """Drop FastAPI's 422 responses and their schemas: a validation error is a 400 here."""
    for methods in doc.get("paths", {}).values():
        for operation in methods.values():
            if isinstance(operation, dict):
                operation.get("responses", {}).pop("422", None)
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)


def _add_components(doc: dict[str, Any], models: list[type[BaseModel]]) -> None:
    """Add ``models`` (and what they reference) to the components, as FastAPI names them."""
    _, defs = models_json_schema([(m, "serialization") for m in models], ref_template=_COMPONENTS + "{model}")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in defs.get("$defs", {}).items():
        schemas.setdefault(name, schema)


def _secure(doc: dict[str, Any]) -> None:
    """With ``--api-key``: the Bearer scheme, required by every protected operation."""
    doc.setdefault("components", {})["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer", "description": "--api-key / $MONOBATCH_API_KEY"}}
    for path, methods in doc.get("paths", {}).items():
        if path.startswith(PROTECTED_PREFIXES):
            for operation in methods.values():
                operation["security"] = [{"bearer": []}]


def _fill_markers(node: Any, facts: dict[str, Any]) -> None:
    """Replace the ``x-monobatch`` markers of protocol.py with what the loaded model decides: a
    model name becomes an enum of the served names (plus "", the first), a token id gets the
    vocabulary's bound, prompt text a ``minLength`` of 1 when the tokenizer adds no token to
    empty text (then "" is an empty prompt, a 400). Before the model is loaded (``facts``
    empty) the markers are only dropped."""
    if isinstance(node, list):
        for item in node:
            _fill_markers(item, facts)
        return
    if not isinstance(node, dict):
        return
    marker = node.pop("x-monobatch", None)
    if marker == MODEL_MARKER and "names" in facts:
        node["enum"] = [*facts["names"], ""]
    elif marker == TOKEN_ID_MARKER and "vocab_size" in facts:
        node["maximum"] = facts["vocab_size"] - 1
    elif marker == PROMPT_TEXT_MARKER and facts.get("empty_text_is_empty"):
        node["minLength"] = 1
    for value in node.values():
        _fill_markers(value, facts)


def _facts(state: "ServerState | None") -> dict[str, Any]:
    """What the loaded model adds to the document (nothing while it loads)."""
    if state is None or state.scheduler is None:
        return {}
    tok = state.tokenizer
    return {"names": list(state.names), "vocab_size": tok.vocab_size, "empty_text_is_empty": not tok.encode("")}


def build_document(app: "FastAPI", settings: "ServerSettings", state: "ServerState | None" = None) -> dict[str, Any]:
    """The OpenAPI document of ``app``: FastAPI's, without 422, with the SSE chunk components,
    the security scheme (``--api-key``) and, when ``state`` holds a loaded model, its names and
    vocabulary size."""
    doc = get_openapi(title=app.title, version=app.version, openapi_version=app.openapi_version,
                      description=app.description, routes=app.routes)
    _without_validation_errors(doc)
    _add_components(doc, [ErrorResponse, *_CHUNKS.values()])
    if settings.api_key is not None:
        _secure(doc)
    _fill_markers(doc, _facts(state))
    return doc


def install_openapi(app: "FastAPI", settings: "ServerSettings", state: "ServerState") -> None:
    """Serve :func:`build_document` as ``app.openapi()``: rebuilt while the model loads, then
    built once and kept."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = build_document(app, settings, state)
        if state.scheduler is not None:
            app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
