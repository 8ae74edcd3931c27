"""Request state: one :class:`Sequence` per request, with a status and derived counts.

The scheduler's single idea (vLLM v1's): there is no prefill or decode phase. Each step a running
sequence's ``num_computed`` (tokens whose KV is cached) catches up with ``num_tokens`` (prompt +
generated). A prompt catches up in chunks; a decode is the case ``num_tokens - num_computed == 1``.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from monobatch.engine.constraint import GrammarMatcher
from monobatch.engine.params import SamplingParams
from monobatch.engine.sampler import SamplerState
from monobatch.engine.stop import StopMatcher
from monobatch.tokenizer import IncrementalDetokenizer

_seq_ids = itertools.count()


@dataclass(slots=True)
class Request:
    """What a client submits: prompt token ids and how to sample them.

    ``request_id`` is the client's key for routing outputs (an OpenAI completion id, say).
    ``bypass_prefix_cache`` computes the whole prompt even when its blocks are cached.
    ``prompt_logprobs`` = k asks for each prompt token's logprob given the tokens before it, with
    the top-k alternatives (0: none), computed inside the normal chunked prefill (implies
    bypassing the prefix cache: every position's logits are needed); delivered on the request's
    first output (vLLM's ``prompt_logprobs``).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.perf_counter)
    bypass_prefix_cache: bool = False
    prompt_logprobs: int | None = None


class SeqStatus(enum.Enum):
    """Lifecycle of a Sequence: WAITING -> RUNNING (-> WAITING on preemption) -> FINISHED."""

    WAITING = "waiting"    # queued, holds no KV
    RUNNING = "running"    # admitted: prefilling or decoding, holds KV
    FINISHED = "finished"  # done (finish_reason set), KV released


class FinishReason(str, enum.Enum):
    """Why a sequence ended (OpenAI's ``finish_reason`` values, plus ``abort``)."""

    STOP = "stop"      # EOS / end-of-generation token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length reached
    ABORT = "abort"    # the client went away or cancelled
    LOOP = "loop"      # loop detection (opt-in, SamplingParams.loop_window) saw a repeating tail


class Sequence:
    """One request in flight: tokens, sampler state, text state and timings.

    Attributes:
        seq_id: engine-wide unique id (the KV store's key).
        prompt_ids / output_ids: token ids (prompt fixed; output grows by one per decode).
        num_computed: tokens whose KV is cached (catches up with ``num_tokens``).
        num_cached_tokens: prompt tokens adopted from the prefix cache at the first admission.
        num_admissions: times admitted (1 + preemptions survived).
        prefill_chunks: the prefill partition: ``(start, end)`` token positions of every chunk
            computed for the sequence except one-token decodes (a preempted sequence's recompute
            appears too); the cached prefix ``[0, num_cached_tokens)`` is not computed.
        max_batch_seqs / shared_steps: most sequences in one step this sequence was part of /
            steps it shared with at least one other sequence (batch-transparency evidence).
        prompt_logprobs: ``[(token_id, logprob | None, top | None)]`` per prompt token so far
            (entry 0 has no logprob) when the request asked for them, else None.
        sampler: per-sequence sampler state (history, seeded RNG, DRY, the structured-output
            grammar matcher when ``params.structured`` is set).
        detok / stop: streaming detokenizer and stop-string matcher.
    """

    def __init__(self, request: Request, detok: IncrementalDetokenizer,
                 grammar: GrammarMatcher | None = None) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request.request_id
        self.prompt_ids = list(request.prompt_ids)
        self.output_ids: list[int] = []
        self.params = request.params
        self.sampler = SamplerState(request.params, self.prompt_ids, request.params.effective_seed(),
                                    token_bytes=detok.tokenizer.token_bytes, grammar=grammar)
        self.detok = detok
        self.stop = StopMatcher(request.params.stop, request.params.include_stop_str_in_output)
        self.status = SeqStatus.WAITING
        self.num_computed = 0
        self.num_cached_tokens = 0
        self.num_admissions = 0
        self.prefill_chunks: list[tuple[int, int]] = []
        self.max_batch_seqs = 0
        self.shared_steps = 0
        self.prompt_logprobs_k = request.prompt_logprobs
        self.bypass_prefix_cache = request.bypass_prefix_cache or request.prompt_logprobs is not None
        self.prompt_logprobs: list[tuple[int, float | None, list[tuple[int, float]] | None]] | None = (
            None if request.prompt_logprobs is None else [(self.prompt_ids[0], None, None)])
        self.prompt_logprobs_sent = False
        self.finish_reason: FinishReason | None = None
        self.arrival_time = request.arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.itl_ms: list[float] = []  # inter-token latencies, ms

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the forward before the next draw."""
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        """True once a finish_reason is set (KV released or about to be)."""
        return self.status is SeqStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while prompt positions whose logprobs were asked for are still to be computed."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    def record_token_time(self, now: float) -> None:
        """Timestamp a new token (``time.perf_counter`` seconds): TTFT on the first, ITL after."""
        if self.last_token_time is not None:
            self.itl_ms.append((now - self.last_token_time) * 1000)
        self.first_token_time = self.first_token_time or now
        self.last_token_time = now

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids ``[start, end)`` of prompt + output."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return (self.prompt_ids[start:] if start < n else []) + self.output_ids[max(start - n, 0):end - n]
