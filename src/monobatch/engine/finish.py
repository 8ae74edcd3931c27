"""FinishStep: the single post-sample step every sequence of every client goes through.

For each row that drew a token, in this order: append the token and push it to the sampler's
history (accept; this also advances a structured-output grammar); decide whether the sequence
ends (end-of-generation id, stop token id, a terminated grammar, stop string, max_tokens,
context length); turn the token into text that is safe to stream (UTF-8
complete, stop-string prefixes held back); set ``finish_reason``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from monobatch.engine.sampler import SampleOutput
from monobatch.engine.sequence import FinishReason, Sequence, SeqStatus

log = logging.getLogger("monobatch")


@dataclass(slots=True)
class RequestMetrics:
    """Timings of a finished request (``time.perf_counter`` seconds).

    TTFT = first token - arrival; decode rate = (tokens - 1) / (finish - first token); ITL =
    the gaps between consecutive tokens (ms), TPOT their mean.

    The prefill partition (``num_cached_tokens`` prompt tokens adopted from the prefix cache,
    then ``prefill_chunks``, the ``(start, end)`` chunks computed) and the batch evidence
    (``max_batch_seqs``, ``shared_steps``) are :class:`Sequence`'s, copied at the finish.
    """

    arrival_time: float
    first_token_time: float | None
    finished_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    itl_ms: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    prefill_chunks: list[tuple[int, int]] = field(default_factory=list)
    max_batch_seqs: int = 0
    shared_steps: int = 0

    @property
    def ttft_ms(self) -> float:
        """Time to first token, ms (arrival -> first draw; the whole prefill)."""
        return ((self.first_token_time or self.finished_time) - self.arrival_time) * 1000

    @property
    def decode_tok_per_s(self) -> float:
        """Decode rate after the first token, tokens/s (0 with fewer than 2 tokens)."""
        span = self.finished_time - (self.first_token_time or self.finished_time)
        return (self.num_output_tokens - 1) / span if self.num_output_tokens > 1 and span > 0 else 0.0

    @property
    def prefill_tok_per_s(self) -> float:
        """Prompt tokens / TTFT, tokens/s (0 when no token was generated)."""
        if self.first_token_time is None or self.ttft_ms <= 0:
            return 0.0
        return self.num_prompt_tokens / (self.ttft_ms / 1000)

    @classmethod
    def of(cls, seq: Sequence) -> "RequestMetrics":
        """The metrics of ``seq``, finishing now."""
        return cls(seq.arrival_time, seq.first_token_time, time.perf_counter(),
                   len(seq.prompt_ids), len(seq.output_ids), list(seq.itl_ms), seq.num_cached_tokens,
                   list(seq.prefill_chunks), seq.max_batch_seqs, seq.shared_steps)


@dataclass(slots=True)
class RowOutput:
    """What one step produced for one request.

    Attributes:
        request_id: the client's key.
        token_ids: tokens generated this step (0 or 1).
        text: new text safe to show now (may be "" while bytes or a stop prefix are held).
        finish_reason: None while running; ``stop`` | ``length`` | ``loop`` | ``abort`` at the end.
        logprobs: ``[(token_id, logprob, top_alternatives)]`` per new token when asked
            (the model's distribution; see the ADR).
        num_prompt_tokens / num_output_tokens: usage so far.
        num_cached_tokens: prompt tokens served by the prefix cache (OpenAI's
            ``usage.prompt_tokens_details.cached_tokens``).
        prompt_logprobs: on a request's first output, when asked: ``[(token_id, logprob | None,
            top | None)]`` per prompt token (the first has none; vLLM's shape).
        metrics: timings, on the final output only.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[tuple[int, float | None, list[tuple[int, float]] | None]] | None = None
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        """True on a request's last output."""
        return self.finish_reason is not None


#: Longest repeating pattern loop detection looks for (tokens).
LOOP_MAX_PERIOD = 32


class FinishStep:
    """Applies a step's draws to their sequences.

    Args:
        eog_ids: every end-of-generation token id of the model (EOS, ``<|im_end|>``, ...).
        max_model_len: the context length in tokens; a sequence reaching it ends with ``length``.
    """

    def __init__(self, eog_ids: frozenset[int], max_model_len: int) -> None:
        self.eog_ids = frozenset(eog_ids)
        self.max_model_len = max_model_len
        self._id_tensors: dict[tuple[frozenset[int], torch.device], torch.Tensor] = {}

    def ban_early_stops(self, logits: torch.Tensor, seqs: list[Sequence], ahead: int = 0) -> torch.Tensor:
        """Mask end-of-generation and stop token ids (``-inf``) for rows that may not end yet:
        ``ignore_eos``, or fewer than ``min_tokens`` generated (vLLM's semantics; llama.cpp's
        ignore_eos is the same -inf bias). Rows with a structured-output grammar are left alone:
        once the grammar is complete it allows only the end-of-generation ids, and banning them
        would leave nothing to draw (documented in docs/server-api.md).

        Args:
            logits: ``[R, V]`` float32, row r for seqs[r]; not modified.
            ahead: tokens each row drew that are not appended yet (async scheduling).

        Returns:
            ``logits`` itself when no row needs a mask, else a masked copy. Rows banning the same
            ids are masked by one launch (every row, or a run of rows: ``index_fill_``; else
            ``index_put_`` with the rows sent in one page-locked copy), not one a row: at B=32 on
            the H200 a launch a row cost 0.3 ms of a 1.4 ms host-bound step (2026-12-02).
        """
        groups: dict[frozenset[int], list[int]] = {}
        for r, seq in enumerate(seqs):
            p = seq.params
            if seq.sampler.grammar is not None:
                continue  # a constrained answer ends where its grammar does (the mask decides)
            early = len(seq.output_ids) + ahead < p.min_tokens
            if not (p.ignore_eos or early):
                continue
            banned = self.eog_ids | frozenset(p.stop_token_ids) if early else self.eog_ids
            if banned:
                groups.setdefault(banned, []).append(r)
        if not groups:
            return logits
        masked = logits.clone()
        for banned, rows in groups.items():
            ids = self._ids(banned, logits.device)
            if rows[-1] - rows[0] == len(rows) - 1:  # a run of rows (rows ascend): a view
                masked[rows[0]:rows[-1] + 1].index_fill_(1, ids, float("-inf"))
                continue
            at = torch.tensor(rows, dtype=torch.int64)
            if logits.is_cuda:
                at = at.pin_memory().to(logits.device, non_blocking=True)
            masked.index_put_((at[:, None], ids[None, :]), masked.new_full((), float("-inf")))
        return masked

    def _ids(self, ids: frozenset[int], device: torch.device) -> torch.Tensor:
        """``ids`` as a device tensor, cached (the same sets recur every step; building one from
        a list is a host-to-device copy)."""
        key = (ids, device)
        t = self._id_tensors.get(key)
        if t is None:
            if len(self._id_tensors) > 64:
                self._id_tensors.clear()
            t = self._id_tensors[key] = torch.tensor(sorted(ids), dtype=torch.int64, device=device)
        return t

    @staticmethod
    def is_looping(tokens: list[int], window: int, max_period: int = LOOP_MAX_PERIOD) -> bool:
        """Loop rule: the last ``window`` generated tokens repeat the ``window`` tokens one period
        ``p`` earlier, for some ``p`` in ``1 .. max_period`` — i.e. the tail of length
        ``window + p`` is periodic with period ``p``. Off when ``window`` is 0.

        Example: window 8 ends ``A B C A B C A B C A B`` (p = 3, 11 tokens periodic).
        """
        if window <= 0:
            return False
        for p in range(1, max_period + 1):
            if len(tokens) >= window + p and tokens[-window:] == tokens[-window - p:-p]:
                return True
        return False

    def _reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if token in p.stop_token_ids or (token in self.eog_ids and not p.ignore_eos):
            return FinishReason.STOP
        grammar = seq.sampler.grammar
        if grammar is not None:  # one llguidance call a row (is_stopped); failed is asked only of a stopped grammar
            if grammar.is_stopped:
                if grammar.failed:
                    log.warning("request %s: its grammar failed mid-answer (%s); ended as abort", seq.request_id,
                                (grammar.error or "").splitlines()[0][:200])
                    return FinishReason.ABORT  # never a "stop" that claims the text matches
                return FinishReason.STOP  # the grammar has terminated (it accepted the end, or nothing can follow)
            if token in self.eog_ids:
                return FinishReason.STOP
        if p.loop_window and self.is_looping(seq.output_ids, p.loop_window):
            return FinishReason.LOOP
        if self.ends_by_length(seq, len(seq.output_ids)):
            return FinishReason.LENGTH
        return None

    def ends_by_length(self, seq: Sequence, num_generated: int) -> bool:
        """True when ``seq`` with ``num_generated`` generated tokens has reached ``max_tokens`` or
        the context length (finish_reason ``length``)."""
        p = seq.params
        return (p.max_tokens is not None and num_generated >= p.max_tokens) \
            or len(seq.prompt_ids) + num_generated >= self.max_model_len

    def apply(self, seqs: list[Sequence], sample: SampleOutput) -> list[RowOutput]:
        """Append each row's token to its sequence and build the step's outputs (one per row)."""
        now = time.perf_counter()
        outputs = []
        eog, stop_reason, reason_of = self.eog_ids, FinishReason.STOP, self._reason
        for r, (seq, token) in enumerate(zip(seqs, sample.token_ids, strict=True)):
            seq.output_ids.append(token)
            seq.sampler.accept(token)
            seq.record_token_time(now)
            reason = reason_of(seq, token)
            # The token that ends a sequence by id (EOS, stop token) adds no text.
            stop = seq.stop
            if reason is stop_reason and (token in eog or token in seq.params.stop_token_ids):
                text = ""
            elif stop.stops:
                text = stop.feed(seq.detok.push(token))
                if stop.matched is not None:  # a stop string wins over length/loop on the same token
                    reason = stop_reason
            else:  # no stop strings: the text as it comes (StopMatcher.feed would return it)
                text = seq.detok.push(token)
            # (request_id, token_ids, text, finish_reason, logprobs, num_prompt_tokens, num_output_tokens,
            # num_cached_tokens): positional, half the keyword call's 0.6 us (a row a step, issue 16)
            out = RowOutput(seq.request_id, [token], text, None, None, len(seq.prompt_ids), len(seq.output_ids),
                            seq.num_cached_tokens)
            if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
                out.prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
            if sample.logprobs is not None and seq.params.logprobs is not None:
                out.logprobs = [(token, sample.logprobs[r], sample.top_logprobs[r] if sample.top_logprobs else [])]
            if reason is not None:
                out.text += self.release(seq)
                self.finish(seq, reason)
                out.finish_reason = reason
                out.metrics = RequestMetrics.of(seq)
            outputs.append(out)
        return outputs

    @staticmethod
    def release(seq: Sequence) -> str:
        """Text still held when a sequence ends (incomplete bytes, a failed stop prefix), once."""
        if seq.stop.matched is not None:
            return ""
        return seq.stop.feed(seq.detok.flush()) + seq.stop.flush()

    @staticmethod
    def finish(seq: Sequence, reason: FinishReason) -> None:
        """Mark ``seq`` finished; the scheduler frees its KV in the same step."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
