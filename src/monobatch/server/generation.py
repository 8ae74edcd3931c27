"""What both generation endpoints share: building engine requests from a body, following each
choice's outputs, usage, logprobs in OpenAI's two shapes, SSE framing and disconnects.

Nothing here decodes: tokens, text, stop strings and finish reasons all come from the engine's
RowOutputs; this module only regroups them per choice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, TypeVar

import torch
from fastapi import Request as HttpRequest

from monobatch.engine.engine import Engine
from monobatch.engine.finish import RowOutput
from monobatch.engine.params import SamplingParams
from monobatch.engine.sequence import Request
from monobatch.tokenizer import Tokenizer

if TYPE_CHECKING:
    from monobatch.server.client import ResponseReader

T = TypeVar("T")
_SEED_MOD = 2**63
#: Request fields this engine version lacks are left out (see the ADR's list of guards).
_REQUEST_FIELDS = {f.name for f in dataclasses.fields(Request)}


def new_id(prefix: str) -> str:
    """An OpenAI-style object id: ``cmpl-...``, ``chatcmpl-...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def build_requests(base_id: str, prompts: list[list[int]], params: SamplingParams, n: int,
                   bypass_prefix_cache: bool = False) -> list[Request]:
    """One engine Request per (prompt, choice), choice index ``prompt * n + j``.

    With ``n > 1`` and a seed, choice ``j`` draws with ``seed + j``: choices differ, choice 0
    equals the same request with ``n = 1``, and every choice is reproducible. Without a seed each
    choice gets a fresh random one (SamplingParams).
    """
    requests = []
    extra = {"bypass_prefix_cache": True} if bypass_prefix_cache and "bypass_prefix_cache" in _REQUEST_FIELDS else {}
    for p, ids in enumerate(prompts):
        for j in range(n):
            choice_params = params if j == 0 or params.seed is None else \
                dataclasses.replace(params, seed=(params.seed + j) % _SEED_MOD)
            requests.append(Request(f"{base_id}-{p * n + j}", ids, choice_params, **extra))
    return requests


@dataclass(slots=True)
class Choice:
    """Everything one sequence produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, out: RowOutput) -> None:
        """Fold one RowOutput in."""
        self.text.append(out.text)
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens = max(self.num_output_tokens, out.num_output_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, getattr(out, "num_cached_tokens", 0) or 0)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason.value


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


# -- logprobs ------------------------------------------------------------------------------------
def token_text(tok: Tokenizer, token_id: int) -> str:
    """One token as text (its bytes; an incomplete UTF-8 sequence shows as U+FFFD)."""
    return tok.token_bytes(token_id).decode("utf-8", errors="replace")


def chat_logprobs(tok: Tokenizer, entries: list[tuple[int, float, list[tuple[int, float]]]]) -> dict:
    """Chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def item(token_id: int, logprob: float) -> dict:
        raw = tok.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top]} for t, lp, top in entries]}


def completion_logprobs(tok: Tokenizer, entries: list[tuple[int, float | None, list[tuple[int, float]] | None]],
                        offset: int) -> dict:
    """Legacy completions' ``logprobs``: parallel lists, ``text_offset`` counted from ``offset``."""
    tokens, offsets = [], []
    for t, _, _ in entries:
        offsets.append(offset)
        tokens.append(token_text(tok, t))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [None if top is None else {token_text(tok, a): b for a, b in top} for _, _, top in entries],
            "text_offset": offsets}


def prompt_logprobs(engine: Engine, ids: list[int], k: int) -> list[tuple[int, float | None, list | None]]:
    """Logprobs of each prompt token given the ones before it (the first has none), with the
    top-``k`` alternatives; the model's distribution, as for generated tokens. Engine thread."""
    logits = engine.prompt_logits(ids, all_positions=True)  # (T, V)
    lsm = torch.log_softmax(logits.float(), dim=-1)[:-1]  # (T-1, V): row i predicts ids[i+1]
    target = torch.tensor(ids[1:], device=lsm.device).unsqueeze(1)
    chosen = lsm.gather(1, target).squeeze(1).tolist()
    if k > 0 and len(ids) > 1:
        top = lsm.topk(k, dim=-1)
        alts = [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    else:
        alts = [[] for _ in chosen]
    return [(ids[0], None, None)] + [(t, lp, a) for t, lp, a in zip(ids[1:], chosen, alts)]


# -- transport -----------------------------------------------------------------------------------
def sse(payload: dict) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def streamed(events: AsyncIterator[str], reader: "ResponseReader") -> AsyncIterator[str]:
    """``events`` for a StreamingResponse, with ``reader`` closed (its sequences aborted) even
    if the client leaves before the first event: a never-started generator runs no ``finally``."""
    weakref.finalize(events, reader.close)
    return events


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
