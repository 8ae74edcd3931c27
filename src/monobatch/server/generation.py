"""What both generation endpoints share: building engine requests from a body, following each
choice's outputs, usage, logprobs in OpenAI's two shapes, SSE framing, disconnects and the one log
line per request (:class:`RequestLog`).

Nothing here decodes: tokens, text, stop strings and finish reasons all come from the engine's
RowOutputs; this module only regroups them per choice.
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from monobatch.engine.finish import RowOutput
from monobatch.engine.params import SamplingParams
from monobatch.engine.sequence import Request
from monobatch.errors import ContextLengthError
from monobatch.server.client import EngineFailed
from monobatch.server.errors import error_body, error_response
from monobatch.tokenizer import Tokenizer

if TYPE_CHECKING:
    from monobatch.server.client import ResponseReader

log = logging.getLogger("monobatch.server")
T = TypeVar("T")
_SEED_MOD = 2**63
#: Room for normalizers when bounding a prompt's characters by the vocabulary's longest token.
PROMPT_CHARS_SLACK = 2


def new_id(prefix: str) -> str:
    """An OpenAI-style object id: ``cmpl-...``, ``chatcmpl-...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def build_requests(base_id: str, prompts: list[list[int]], params: SamplingParams, n: int, *,
                   arrival_time: float, bypass_prefix_cache: bool = False,
                   prompt_logprobs: int | None = None) -> list[Request]:
    """One engine Request per (prompt, choice), choice index ``prompt * n + j``.

    With ``n > 1`` and a seed, choice ``j`` draws with ``seed + j`` modulo 2**63 (a seed near the
    top wraps to 0: every choice's seed stays in SamplingParams' range): choices differ, choice 0
    equals the same request with ``n = 1``, and every choice is reproducible. Without a seed each
    choice gets a fresh random one (SamplingParams). This is the one place per-choice seeds are
    made (the CLI and the Python API have no ``n``).

    Args:
        arrival_time: when the HTTP request arrived (``time.perf_counter``): TTFT and e2e
            latency are timed from it.
        bypass_prefix_cache: do not adopt cached prefix blocks (``cache_prompt: false``).
        prompt_logprobs: ask the engine for prompt logprobs with this many alternatives (every
            choice asks: each delivers them on its own first output).
    """
    requests = []
    for p, ids in enumerate(prompts):
        for j in range(n):
            choice_params = params if j == 0 or params.seed is None else \
                dataclasses.replace(params, seed=(params.seed + j) % _SEED_MOD)
            requests.append(Request(f"{base_id}-{p * n + j}", ids, choice_params, arrival_time=arrival_time,
                                    bypass_prefix_cache=bypass_prefix_cache, prompt_logprobs=prompt_logprobs))
    return requests


@dataclass(slots=True)
class Choice:
    """Everything one sequence produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    prompt_logprobs: list[tuple[int, float | None, list[tuple[int, float]] | None]] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    ttft_ms: float | None = None  # the engine's RequestMetrics, on the final output
    #: The finish_reason the response reported, where the endpoint maps the engine's (chat's
    #: ``tool_calls``: ``ChatPrompt.finish_reason``); None: the engine's, as it is.
    api_finish_reason: str | None = None

    def add(self, out: RowOutput) -> None:
        """Fold one RowOutput in."""
        if out.metrics is not None and out.metrics.first_token_time is not None:
            self.ttft_ms = out.metrics.ttft_ms
        self.text.append(out.text)
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens = max(self.num_output_tokens, out.num_output_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason.value

    @property
    def reported_finish_reason(self) -> str | None:
        """The finish_reason the API reported for this choice (the engine's unless the endpoint mapped it)."""
        return self.api_finish_reason or self.finish_reason


def usage(choices: list[Choice], n: int) -> dict[str, Any]:
    """OpenAI's usage: each prompt counted once (not once per choice), every choice's tokens,
    and the prompt tokens adopted from the prefix cache."""
    prompts = [choices[i:i + n] for i in range(0, len(choices), n)]
    prompt_tokens = sum(group[0].num_prompt_tokens for group in prompts)
    completion_tokens = sum(c.num_output_tokens for c in choices)
    cached = sum(max(c.num_cached_tokens for c in group) for group in prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


# -- the request log ------------------------------------------------------------------------------
@dataclass(slots=True)
class RequestLog:
    """The one INFO line a generation request logs when it ends, as vLLM's and llama-server's
    servers do (logger ``monobatch.server``; ``serve --log-level``): finished (its id, endpoint,
    stream or not, prompt and completion tokens as :func:`usage` counts them, the finish reason
    per choice as the response reported it (:attr:`Choice.reported_finish_reason`: chat's
    ``tool_calls``), TTFT — the first choice's first token, from the engine's
    ``RequestMetrics`` — and the total time since the HTTP request arrived), aborted (the client disconnected), or
    failed (a WARNING): the engine ended it, or a bug did (:meth:`crashed`). A request refused
    before it ran is logged by the error handlers instead (``errors.install_handlers``).

    Args:
        request_id: the response's ``id``.
        endpoint: the request's path.
        arrival: ``time.perf_counter()`` when the HTTP request arrived.
        stream: whether it was streamed.
        n: choices per prompt (for :func:`usage`).
    """

    request_id: str
    endpoint: str
    arrival: float
    stream: bool
    n: int
    done: bool = False

    def _elapsed_ms(self) -> float:
        return (time.perf_counter() - self.arrival) * 1000

    def finished(self, choices: list[Choice], counted: dict[str, Any] | None = None) -> None:
        """Log a request that ran to its end; ``counted``: ``usage(choices, n)`` where the
        response already holds it (not counted twice)."""
        if self.done:
            return
        self.done = True
        u = counted if counted is not None else usage(choices, self.n)
        ttfts = [c.ttft_ms for c in choices if c.ttft_ms is not None]
        ttft = f"{min(ttfts):.1f}" if ttfts else "-"
        reasons = ",".join(c.reported_finish_reason or "-" for c in choices)
        log.info("%s %s finished: stream=%s prompt_tokens=%d completion_tokens=%d finish_reason=%s ttft_ms=%s "
                 "total_ms=%.1f", self.request_id, self.endpoint, str(self.stream).lower(), u["prompt_tokens"],
                 u["completion_tokens"], reasons, ttft, self._elapsed_ms())

    def aborted(self, choices: list[Choice] | None = None) -> None:
        """Log a request its client left before the end (its sequences are aborted)."""
        if self.done:
            return
        self.done = True
        tokens = f" completion_tokens={sum(c.num_output_tokens for c in choices)}" if choices else ""
        log.info("%s %s aborted (client disconnected): stream=%s%s total_ms=%.1f", self.request_id, self.endpoint,
                 str(self.stream).lower(), tokens, self._elapsed_ms())

    def failed(self, status: int, message: str) -> None:
        """Log a request the engine ended (a step raised, shutdown): WARNING."""
        if self.done:
            return
        self.done = True
        log.warning("%s %s failed: %d %s (stream=%s, total_ms=%.1f)", self.request_id, self.endpoint, status, message,
                    str(self.stream).lower(), self._elapsed_ms())

    def crashed(self, exc: BaseException) -> None:
        """Log a request a bug ended (an exception while its response was shaped or sent):
        :meth:`failed` with 500 and the exception's type only, so the one-line request log stays
        bounded; the message is in the traceback, logged where the exception is caught."""
        self.failed(500, type(exc).__name__)


# -- prompts -------------------------------------------------------------------------------------
def max_prompt_chars(tok: Tokenizer, max_model_len: int) -> int:
    """The most characters a prompt that fits the context can have: every token is at most the
    vocabulary's longest token (in bytes, and a character is at least one byte), doubled for
    normalizers. Longer text is refused before tokenizing it (:func:`check_prompt_chars`)."""
    longest = max(len(tok.token_bytes(t)) for t in range(tok.vocab_size))
    return max_model_len * max(longest, 1) * PROMPT_CHARS_SLACK


def check_prompt_chars(num_chars: int, limit: int, max_model_len: int, param: str) -> None:
    """Refuse a prompt whose text cannot fit the context, without tokenizing it.

    Raises:
        ContextLengthError: ``num_chars`` over ``limit`` (see :func:`max_prompt_chars`).
    """
    if num_chars > limit:
        raise ContextLengthError(f"the prompt has {num_chars} characters, more than {max_model_len} tokens (the "
                                 f"context) can hold", param)


async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a worker thread (tokenization, chat templates): the event loop
    keeps serving other clients meanwhile."""
    return await asyncio.to_thread(fn, *args, **kwargs)


async def compile_constraint(grammars, params: SamplingParams) -> None:
    """Compile a request's structured-output constraint on a worker thread, before it reaches the
    engine thread (a bad one is a 400 before any SSE byte; a slow one is refused after
    ``constraint.COMPILE_TIMEOUT_S`` and never stalls the decode loop).

    Raises:
        InvalidRequestError: the constraint does not compile.
    """
    if params.structured is not None:
        await off_loop(grammars.compile, params.structured)


# -- logprobs ------------------------------------------------------------------------------------
def chat_logprobs(tok: Tokenizer, entries: list[tuple[int, float, list[tuple[int, float]]]]) -> dict:
    """Chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def item(token_id: int, logprob: float) -> dict:
        raw = tok.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top]} for t, lp, top in entries]}


class TextOffsets:
    """Where each token starts in the text, in characters (legacy completions' ``text_offset``).

    A token starts after the characters its predecessors completed: the bytes of a character
    split across tokens count once it is complete (both halves of a split emoji start at the
    emoji), whatever text the engine held back. Streamed and non-streamed responses feed the
    same tokens through one of these per choice, so they agree.
    """

    def __init__(self, tok: Tokenizer, start: int = 0) -> None:
        self._tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pos = start

    def take(self, token_id: int) -> int:
        """The offset of ``token_id``, the next token; advances past it."""
        at = self.pos
        self.pos += len(self._utf8.decode(self._tok.token_bytes(token_id)))
        return at


def completion_logprobs(tok: Tokenizer, entries: list[tuple[int, float | None, list[tuple[int, float]] | None]],
                        offsets: TextOffsets) -> dict:
    """Legacy completions' ``logprobs``: parallel lists; ``text_offset`` from ``offsets``."""
    return {"tokens": [tok.token_text(t) for t, _, _ in entries],
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [None if top is None else {tok.token_text(a): b for a, b in top} for _, _, top in entries],
            "text_offset": [offsets.take(t) for t, _, _ in entries]}


# -- transport -----------------------------------------------------------------------------------
def sse(payload: dict) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def stream_frame(reader: "ResponseReader", events: AsyncIterator[str], choices: list[Choice], n: int,
                       include_usage: bool, chunk: Callable[[list, dict], dict],
                       record: RequestLog) -> AsyncIterator[str]:
    """The frame every streamed response shares (OpenAI API): ``events`` — the endpoint's chunks,
    read while ``reader`` is open — then, with ``stream_options.include_usage``, one chunk with no
    choices and the usage of ``choices`` (``chunk(rows, usage)`` builds it), then ``[DONE]``. An
    engine failure ends the body with an error event before ``[DONE]``. ``record`` logs the end
    (a client that leaves: :class:`EventStream`)."""
    try:
        async with reader:
            async for event in events:
                yield event
        counted = usage(choices, n)  # once: the usage chunk and the log line
        tail = sse(chunk([], counted)) if include_usage else None  # shaped before it is logged finished
        record.finished(choices, counted)
        if tail is not None:
            yield tail
    except EngineFailed as exc:
        record.failed(exc.status, str(exc))
        yield sse(error_body(exc.status, str(exc), code=exc.code))
    yield SSE_DONE


class EventStream(StreamingResponse):
    """An SSE response whose reader is closed (its unfinished sequences aborted) however the
    response ends — also when the client leaves before the first event, where a never-started
    generator would run no ``finally`` — and whose request is logged (:class:`RequestLog`;
    ``choices``: what it had produced) as failed when an exception other than a client's
    disconnect ended it (:meth:`RequestLog.crashed`), as aborted when it ended before its frame
    did otherwise: the client left (Starlette's ``ClientDisconnect``, or the stream cancelled when
    the disconnect came)."""

    def __init__(self, events: AsyncIterator[str], reader: "ResponseReader", record: RequestLog,
                 choices: list[Choice]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._reader, self._record, self._choices = reader, record, choices

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            raise
        except Exception as exc:  # a bug mid-stream (a cancellation is no Exception: the client left)
            self._record.crashed(exc)
            raise
        finally:
            self._reader.close()
            self._record.aborted(self._choices)  # a no-op once finished or failed


def created() -> int:
    """The ``created`` timestamp (Unix seconds)."""
    return int(time.time())


async def _disconnected(request: HttpRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The client closed the connection before the (non-streamed) answer was ready."""


async def unless_disconnected(request: HttpRequest, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it (which aborts its
    sequences) and raise ClientGone. Streams need no such watch: Starlette cancels them."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled (server shutdown)
        task.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    return task.result()


async def respond(http: HttpRequest, reader: "ResponseReader", collect: Awaitable[list[Choice]],
                  shape: Callable[[list[Choice]], dict], record: RequestLog) -> Response:
    """The non-streamed answer: ``shape`` of what ``collect`` gathered from ``reader``.

    The reader is closed however this ends (its unfinished sequences aborted): the client went
    away (no answer; the sequences are aborted), the engine ended the request (EngineFailed: a
    500, or a 503 while shutting down or after the engine stopped), or this handler was cancelled.
    ``record`` logs how it ended: finished once the answer is shaped and rendered; a bug there
    (or while collecting) is logged as failed (:meth:`RequestLog.crashed`) and raised to the
    handlers' 500.
    """
    try:
        choices = await unless_disconnected(http, collect)
        shaped = shape(choices)
        answer = JSONResponse(shaped)
    except ClientGone:
        record.aborted()
        return Response(status_code=499)
    except EngineFailed as exc:  # answered here, not by the handlers: logged once, with the request's id
        record.failed(exc.status, str(exc))
        return error_response(exc.status, str(exc), code=exc.code)
    except Exception as exc:
        record.crashed(exc)
        raise
    finally:
        reader.close()
    record.finished(choices, shaped.get("usage"))  # the body's usage, not counted again
    return answer
