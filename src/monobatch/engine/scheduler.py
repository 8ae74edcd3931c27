"""BatchScheduler: the one decode loop. Every client — CLI, server, Python API — drives it.

NOTE (the whole algorithm, after vLLM v1): there is no prefill or decode phase. Each step, each
running sequence's ``num_computed`` catches up with its ``num_tokens``. A step:

1. *running first*: every running decode gets its one token, then running prompts get chunks
   (:class:`PrefillPlan`), within the step's token budget. Each chunk reserves its KV blocks; when
   the pool is out of blocks the newest running sequence is preempted (recompute: KV freed,
   requeued at the front, tokens and sampler state kept) until the chunk fits.
2. *then admission*, FIFO, if nothing was preempted: a waiting sequence adopts its cached
   prefix, reserves blocks for its first chunk and joins the batch — while ``max_num_seqs``,
   the budget and free blocks allow.
3. ``Engine.step``: forward + sample + finish; a chunk that reaches its sequence's last token
   asks for logits, and that sequence draws one token. Finished sequences release their KV
   (their full blocks stay in the prefix cache) in the same step.

Async scheduling (``Engine.async_scheduling``, on for CUDA; vLLM's async scheduling, SGLang's
overlap scheduler): a decode step whose rows draw without looking at their history
(:attr:`SamplerState.history_free`) is launched and left pending; the next :meth:`step` launches
step N+1 — same sequences, input ids taken from N's draws on the device — *before* reading N's
draws back, then runs N's finish step while the device computes N+1. Rows with a
structured-output grammar take part too. Greedy ones (:attr:`SamplerState.greedy_checked`) draw
their raw argmax on the device, unchecked; when N is read back each draw is checked against its
grammar (llama.cpp's "sampled token first"): an allowed one is the grammar's best token already, a
refused one is redrawn from the tokens the grammar accepts (a side stream, so the device stays busy), and N+1,
launched on the refused id, leaves that row *void* — its KV position is not committed and the
next step recomputes it from the corrected id. Refusals happen mostly where the grammar forces
the next bytes (a key, a quote, a separator): once N's tokens are accepted, the rows of N+1 at
such a position are redrawn among the few tokens that can spell the forced bytes before N+2 reads
them (:meth:`Engine.draw_forced`), so they are nearly never void (a refused redraw is corrected
and voided as above). Other grammar rows (sampled, logit_bias) have
the draw of N+1 deferred: its forward is queued first, then N's tokens are read and accepted
into the matchers, and the masks of N+1 are computed on the host while that forward runs
(:meth:`Engine.draw_deferred`). Step N+1's KV commit
waits until N's ids are known. A sequence that ends at N (a stop id or string) had one row too
many in N+1: that row is dropped. Anything else — an admission, a prefill, a sequence that
ends by length at N, a penalty or logprobs — resolves N first and plans normally. Outputs come
one step later. Tokens are the same as the synchronous loop's at B=1 and in deterministic mode;
in the default mode a batch that loses a sequence computes one step at the old batch size,
which can move a near-tie token exactly as any change of batch size does there.

Finish observers (:meth:`BatchScheduler.add_finish_observer`) see every sequence that ends — its
prompt and generated ids and its :class:`RequestMetrics` — on the thread that drives the loop;
``monobatch parity`` uses them to read what a server generated without going through HTTP.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from monobatch.batch import Chunk, StepBatch
from monobatch.engine.engine import Engine, PendingStep
from monobatch.engine.finish import RequestMetrics, RowOutput
from monobatch.engine.metrics import SchedulerStats
from monobatch.engine.planner import PrefillPlan
from monobatch.engine.params import SamplingParams
from monobatch.engine.sequence import FinishReason, Request, Sequence, SeqStatus
from monobatch.errors import ContextLengthError, InvalidRequestError
from monobatch.tokenizer import IncrementalDetokenizer

log = logging.getLogger("monobatch")


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """What a finish observer gets for each sequence that ends (copies: safe to keep).

    Attributes:
        request_id: the client's key.
        prompt_ids / output_ids: the prompt and every generated token id.
        finish_reason: ``stop`` | ``length`` | ``loop`` | ``abort``.
        metrics: timings, prompt tokens adopted from the prefix cache, the prefill partition.
    """

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: FinishReason
    metrics: RequestMetrics


class BatchScheduler:
    """Continuous batching over an :class:`Engine`: FIFO admission by free KV blocks and
    ``max_num_seqs``, chunked prefill, prefix-cache adoption, preemption by recompute.

    Args:
        engine: the model, KV cache, sampler and finish step.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.config = engine.config
        self.plan = PrefillPlan(engine.config.prefill_chunk, engine.config.token_budget(engine.device.type))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._done: list[RowOutput] = []  # outputs produced outside a forward (max_tokens 0, abort)
        self._stats = SchedulerStats()
        self._finish_observers: list[Callable[[FinishedRequest], None]] = []
        self._pending: PendingStep | None = None  # a launched decode step not read back yet

    def add_finish_observer(self, fn: Callable[[FinishedRequest], None]) -> None:
        """Call ``fn(FinishedRequest)`` for every sequence that ends from now on (any
        finish_reason), on the thread that drives the loop, before the step returns its outputs.
        ``fn`` must be quick and must not block; an exception it raises is logged and ignored."""
        self._finish_observers.append(fn)

    def _notify_finished(self, seq: Sequence) -> None:
        if not self._finish_observers:
            return
        record = FinishedRequest(seq.request_id, list(seq.prompt_ids), list(seq.output_ids), seq.finish_reason,
                                 RequestMetrics.of(seq))
        for fn in self._finish_observers:
            try:
                fn(record)
            except Exception:  # noqa: BLE001 - an observer never breaks the loop
                log.exception("a finish observer failed")

    # -- start-up -------------------------------------------------------------------------
    def warm_up(self, burst: bool | None = None) -> None:
        """Prepare everything the first requests would otherwise wait for (the server calls this
        before it reports ready): the engine's CUDA graphs (:meth:`Engine.warm_up`), then, on a
        CUDA paged store, a synthetic burst run through this loop — :func:`warm_up_requests`: up
        to 64 prompts of unlike lengths past the step's token budget, greedy and seeded rows — so
        the Triton kernels of the eager steps (prompt-only and mixed steps, whose token counts
        pick a kernel specialisation) are JIT-compiled now rather than inside the first burst's
        TTFT. On the H200 (llama-1b, bench-serve 300 x 256 + 128, concurrency 64) five kernels were
        compiled inside the first round without it: TTFT p99 2.33 s, against 0.20 s in the next
        round on the same server (docs/benchmarks, 2026-12-03 serving TTFT). vLLM runs a dummy
        forward of the step budget at start-up for the same reason (and to size memory).

        The burst leaves nothing behind: its sequences finish, their blocks leave the prefix
        cache (:meth:`~monobatch.kv.paged.PagedKv.clear_prefix_cache`) and the counters of
        :meth:`stats` restart from zero.

        Args:
            burst: run the burst (None: on CUDA with paged storage only; CPU compiles nothing at
                run time, and dense storage would give every prompt a whole context's buffer).

        Raises:
            RuntimeError: requests are already in flight (call it before serving).
        """
        if self.has_unfinished():
            raise RuntimeError("warm_up: requests are in flight")
        self.engine.warm_up()
        if burst is None:
            burst = self.engine.device.type == "cuda"
        capacity = self.kv.capacity_tokens()
        if not burst or capacity is None:
            return
        requests = warm_up_requests(self.engine.vocab_size, self.config.max_num_seqs, self.plan.token_budget,
                                    self.engine.max_model_len, capacity // 4)
        calls = self.kv.paged_attention_calls
        for _ in self.run(requests):
            pass
        self.kv.clear_prefix_cache()
        self._stats = SchedulerStats()
        self.kv.paged_attention_calls = calls  # the burst is no step of a request (as graph capture)

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Validate and queue a request.

        Raises:
            InvalidRequestError: an empty prompt, a token id outside the vocabulary, a bad
                sampling value, a request id already in flight, a structured-output constraint that
                does not compile (compile it first with ``engine.grammars.compile`` off this
                thread: here it would run on the loop's). ContextLengthError: the prompt leaves no
                room to generate.
        """
        vocab = self.engine.vocab_size
        n, limit = len(request.prompt_ids), self.engine.max_model_len
        if n == 0:
            raise InvalidRequestError("the prompt is empty (it must contain at least one token)", "prompt")
        if any(not 0 <= t < vocab for t in request.prompt_ids):
            raise InvalidRequestError(f"the prompt contains a token id outside the vocabulary (size {vocab})", "prompt")
        if n >= limit:
            raise ContextLengthError(
                f"the prompt has {n} tokens but the context is {limit} tokens (at least one must be left to generate)",
                "prompt")
        if self._find(request.request_id) is not None:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight", "request_id")
        request.params.check_vocab(vocab)
        if request.prompt_logprobs is not None and not 0 <= request.prompt_logprobs <= 20:
            raise InvalidRequestError("prompt_logprobs must be between 0 and 20", "prompt_logprobs")
        if request.prompt_logprobs is not None and request.params.max_tokens == 0:
            raise InvalidRequestError("prompt_logprobs needs max_tokens >= 1", "max_tokens")
        structured = request.params.structured
        grammar = self.engine.grammars.matcher(structured) if structured is not None else None
        detok = IncrementalDetokenizer(self.engine.tokenizer, request.prompt_ids, request.params.skip_special_tokens)
        seq = Sequence(request, detok, grammar)
        if request.params.max_tokens == 0:
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = FinishReason.LENGTH
            self._done.append(RowOutput(seq.request_id, finish_reason=FinishReason.LENGTH, num_prompt_tokens=n,
                                        metrics=RequestMetrics.of(seq)))
            self._stats.num_requests_finished += 1
            self._notify_finished(seq)
            return
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV; its final output (``abort``) comes from the next
        :meth:`step`. Returns False when the id is unknown or already finished."""
        seq = self._find(request_id)
        if seq is None:
            return False
        # (a sequence a failed step finished but did not release is in running too: it ends as abort)
        (self.running if seq in self.running else self.waiting).remove(seq)
        self.kv.free(seq.seq_id)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, FinishReason.ABORT
        self._done.append(RowOutput(seq.request_id, finish_reason=FinishReason.ABORT,
                                    num_prompt_tokens=len(seq.prompt_ids), num_output_tokens=len(seq.output_ids),
                                    num_cached_tokens=seq.num_cached_tokens, metrics=RequestMetrics.of(seq)))
        self._stats.num_requests_finished += 1
        self._notify_finished(seq)
        return True

    def preempt(self, request_id: str) -> bool:
        """Preempt by recompute: free a running sequence's KV and requeue it at the front.

        Its generated tokens and sampler state are kept, so when re-admitted it recomputes
        prompt + output (adopting whatever the prefix cache still holds) and continues exactly
        where it stopped (a seeded draw depends only on seed and position). A pending async step
        holding it is resolved first (its outputs come from the next :meth:`step`). Returns
        False when the id is not running.
        """
        seq = self._find(request_id)
        if seq is None or seq.status is not SeqStatus.RUNNING:
            return False
        if self._pending is not None and seq in self._pending.rows:  # its last draw first
            pending, self._pending = self._pending, None
            self._done += self._finish_pending(pending)
            if seq.is_finished:
                return False
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self._stats.num_preemptions += 1
        return True

    @property
    def kv(self):
        """The engine's KV store."""
        return self.engine.kv

    def has_unfinished(self) -> bool:
        """True while any request is waiting, running, or has an undelivered final output."""
        return bool(self.waiting or self.running or self._done or self._pending)

    def stats(self) -> SchedulerStats:
        """Counters and gauges for metrics (a copy)."""
        usage = self.kv.usage()
        s = self._stats
        return SchedulerStats(len(self.running), len(self.waiting), usage.used_blocks, usage.total_blocks,
                              usage.cached_blocks, usage.used_bytes, s.prefix_cache_queries, s.prefix_cache_hits,
                              s.prompt_tokens_total, s.generation_tokens_total, s.num_preemptions,
                              s.num_requests_finished,
                              paged_attention_calls=self.kv.paged_attention_calls)

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> list[RowOutput]:
        """One iteration: schedule (running first, then admission), forward + sample + finish,
        release finished KV."""
        outputs, self._done = self._done, []
        if self._pending is not None:
            pending, self._pending = self._pending, None
            ahead = None
            try:
                ahead = self._launch_ahead(pending)
                outputs += self._finish_pending(pending, ahead)
                if ahead is not None and ahead.tokens is None:  # its grammar masks needed N's tokens
                    self.engine.draw_deferred(ahead)
                elif ahead is not None and ahead.check is not None:  # forced grammar positions, redrawn
                    self.engine.draw_forced(ahead)
            except BaseException:
                # N's draws (and N+1's) are lost with the error: end their sequences (abort, KV
                # freed); outputs already due are kept for the next step.
                self._done[:0] = outputs
                for seq in pending.rows + (ahead.rows if ahead is not None else []):
                    if self._find(seq.request_id) is seq:
                        self.abort(seq.request_id)
                raise
            outputs, self._done = outputs + self._done, []
            if ahead is not None and any(not seq.is_finished for seq in ahead.rows):
                self._pending = ahead
                return outputs
        try:
            planned = self._schedule()
        except BaseException:
            # A planning failure is a bug; end the running sequences (abort, KV freed) so a client
            # that keeps stepping makes progress instead of failing the same way forever.
            self._done[:0] = outputs  # outputs already due are not lost
            for seq in list(self.running):
                self.abort(seq.request_id)
            raise
        if planned is None:
            return outputs
        batch, rows, prompt_rows = planned
        try:
            if self.engine.async_scheduling and not prompt_rows and batch.is_decode_only and self._overlappable(rows):
                pending = self.engine.launch(batch, rows, unchecked=self._unchecked(rows))
                self.engine.draw_forced(pending)
                self._pending = pending
                return outputs
            step_outputs = self.engine.step(batch, rows, prompt_rows)
        except BaseException:
            # Never leave KV and num_computed disagreeing: the step's sequences end (abort) and
            # free their KV; outputs already due are kept for the next step; the error
            # propagates to the client that drives the loop.
            self._done[:0] = outputs
            for c in batch.chunks:
                seq = self._find_seq_id(c.seq_id)
                if seq is not None:
                    self.abort(seq.request_id)
            raise
        return outputs + self._after_step(step_outputs)

    def _after_step(self, step_outputs: list[RowOutput]) -> list[RowOutput]:
        """Count the step's tokens; release the KV of sequences that finished."""
        self._stats.generation_tokens_total += sum(len(o.token_ids) for o in step_outputs)
        for seq in [s for s in self.running if s.is_finished]:
            self.running.remove(seq)
            self.kv.free(seq.seq_id)
            self._stats.num_requests_finished += 1
            self._notify_finished(seq)
        return step_outputs

    # -- async scheduling -------------------------------------------------------------------
    def _launch_ahead(self, pending: PendingStep) -> PendingStep | None:
        """Launch the decode step after ``pending`` before its draws are read back, when that
        step is certain to hold the same sequences (see the module docstring); else None."""
        rows = pending.rows
        if len(rows) != len(self.running) or (self.waiting and len(self.running) < self.config.max_num_seqs) \
                or not self._overlappable(rows):
            return None
        # one pass over the rows for the other checks (B rows a step: hot)
        ends_by_length, void, running = self.engine.finisher.ends_by_length, pending.void, SeqStatus.RUNNING
        grammar = False
        for r, seq in enumerate(rows):
            if seq.status is not running:
                return None
            grammar = grammar or seq.sampler.grammar is not None
            if r in void:  # N drew nothing for it: its input is its last accepted id
                if seq.num_computed != seq.num_tokens - 1:
                    return None
            elif seq.num_computed != seq.num_tokens or ends_by_length(seq, len(seq.output_ids) + 1):
                return None  # not a plain decode, or the pending step is its last by length
        reserve = self.kv.reserve
        for seq in rows:
            if not reserve(seq.seq_id, seq.num_computed + 1):
                return None  # the pool is full: the normal path preempts
        chunks = [(seq.seq_id, (0,), seq.num_computed, True) for seq in rows]  # ids: the device's draws
        # a void row's input is the id that replaced its refused draw
        replace = {r: rows[r].output_ids[-1] for r in sorted(void)}
        for seq in rows:  # (batch evidence at the commit: a row that turns void is no step of its sequence)
            seq.num_computed += 1
        batch = self.engine.build_batch(chunks)
        # grammar rows: greedy ones draw their raw argmax now, checked once N's tokens are accepted
        # (Engine.resolve); any other draws once they are (deferred)
        unchecked = grammar and self._unchecked(rows)
        defer = grammar and not unchecked
        try:
            return self.engine.launch(batch, rows, ahead=1, token_ids=pending.tokens, defer_draw=defer,
                                      unchecked=unchecked, replace=replace)
        except BaseException:
            for seq in rows:
                seq.num_computed -= 1
            raise

    def _finish_pending(self, pending: PendingStep, ahead: PendingStep | None = None) -> list[RowOutput]:
        """Read ``pending``'s draws and run its finish step; then commit ``ahead`` (launched on
        those draws) for the sequences still running, now that its input ids are known."""
        step_outputs = self.engine.resolve(pending)
        if ahead is not None:
            for r in pending.corrected:  # ahead computed it from the refused draw: void, recomputed next
                ahead.void.add(r)
                if not ahead.rows[r].is_finished:
                    ahead.rows[r].num_computed -= 1
            live, void, n = [], ahead.void, len(ahead.rows)
            for r, (c, seq) in enumerate(zip(ahead.batch.chunks, ahead.rows)):
                if not seq.is_finished and r not in void:
                    live.append(Chunk(c.seq_id, c.start, c.pos, c.length, c.wants_logits, (seq.output_ids[-1],)))
                    # counted here, not at the launch: a void row (recomputed next step) or the row of
                    # a sequence that ended at ``pending`` is not one of its sequence's steps
                    self._account(seq, n)
            self.kv.commit(dataclasses.replace(ahead.batch, chunks=tuple(live), position_bound=None, decode_only=None))
        return self._after_step(step_outputs)

    @staticmethod
    def _overlappable(rows: list[Sequence]) -> bool:
        """True when every row's next draw can be made before its last token is known on the
        host (:attr:`SamplerState.history_free`), or right after it is accepted while the next
        forward runs (:attr:`SamplerState.grammar_only`: a deferred draw)."""
        return bool(rows) and all(seq.sampler.history_free or seq.sampler.grammar_only for seq in rows)

    @staticmethod
    def _unchecked(rows: list[Sequence]) -> bool:
        """True when the step has grammar rows and every row is a greedy draw needing at most the
        grammar mask (:attr:`SamplerState.greedy_checked`): the grammar rows draw their raw
        argmax on the device, and :meth:`Engine.resolve` checks it once the previous tokens are
        accepted — no mask and no wait on most steps; a refused draw is redrawn from the tokens the grammar accepts
        and the step launched on it recomputes that row (its draw is void)."""
        return any(seq.sampler.grammar is not None for seq in rows) and \
            all(seq.sampler.argmax_draw for seq in rows)

    def _account(self, seq: Sequence, batch_seqs: int) -> None:
        """Batch evidence for the request's metrics: one step of ``seq`` (a prompt chunk, or a
        decode whose KV is kept) computed beside ``batch_seqs - 1`` other rows. Async scheduling
        counts an ahead step's row when it is committed (:meth:`_finish_pending`), so a void row's
        recompute is counted once and ``shared_steps`` stays within the request's steps
        (prompt chunks + generated tokens - 1)."""
        seq.max_batch_seqs = max(seq.max_batch_seqs, batch_seqs)
        seq.shared_steps += batch_seqs > 1

    def run(self, requests: Iterable[Request] = ()) -> Iterator[RowOutput]:
        """Add ``requests`` and step until nothing is left, yielding every output as produced."""
        for request in requests:
            self.add_request(request)
        while self.has_unfinished():
            yield from self.step()

    # -- scheduling -----------------------------------------------------------------------
    def _schedule(self) -> tuple[StepBatch, list[Sequence], dict[int, Sequence]] | None:
        """Plan one step (see the module docstring); None when there is nothing to compute."""
        budget = self.plan.token_budget
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        # 1. running sequences: decodes first, then prompt chunks (stable: FIFO within each).
        for seq in sorted(self.running, key=lambda s: s.num_uncomputed > 1):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted below as a victim
            n = self.plan.chunk_len(seq, budget)
            if n == 0:
                continue
            while not self.kv.reserve(seq.seq_id, seq.num_computed + n):
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    # Unreachable while the pool holds one context (checked at start-up).
                    raise RuntimeError(f"the KV pool cannot hold sequence {seq.request_id!r} alone")
                budget += sum(m for s, m in scheduled if s is victim)
                scheduled = [(s, m) for s, m in scheduled if s is not victim]
                self.preempt(victim.request_id)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
        # 2. admission, FIFO, while sequences, budget and blocks allow.
        while not preempted and self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            cached = self.plan.adopt_cached_prefix(seq, self.kv)
            n = self.plan.chunk_len(seq, budget)
            if not self.kv.reserve(seq.seq_id, seq.num_computed + n):
                self.kv.free(seq.seq_id)  # give the adopted blocks back; wait for free blocks
                seq.num_computed = 0
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
            if seq.num_admissions == 0:  # a preempted sequence re-enters: counted once
                seq.num_cached_tokens = cached
                self._stats.prompt_tokens_total += len(seq.prompt_ids)
                if self.kv.block_size is not None and not seq.bypass_prefix_cache:
                    self._stats.prefix_cache_queries += len(seq.prompt_ids)
                    self._stats.prefix_cache_hits += cached
            seq.num_admissions += 1
        assert budget >= 0 and len(self.running) <= self.config.max_num_seqs, "scheduler invariant broken"
        return self._build(scheduled)

    def _build(self, scheduled: list[tuple[Sequence, int]]) -> tuple[StepBatch, list[Sequence], dict[int, Sequence]] | None:
        """The StepBatch of the planned chunks, the sequences that draw a token, and the
        sequences (by seq id) whose chunks return every row's logits for prompt logprobs."""
        if not scheduled:
            return None
        chunks, rows = [], []
        for seq, n in scheduled:
            start = seq.num_computed
            wants = start + n == seq.num_tokens
            if n > 1 or start < len(seq.prompt_ids):  # the prefill partition (decodes are not recorded)
                seq.prefill_chunks.append((start, start + n))
            self._account(seq, len(scheduled))
            chunks.append((seq.seq_id, seq.token_slice(start, start + n), start, wants,
                           self.plan.wants_all_logits(seq, start)))
            seq.num_computed += n
            if wants:
                rows.append(seq)
        prompt_rows = {seq.seq_id: seq for seq, _ in scheduled if seq.wants_prompt_logprobs}
        return self.engine.build_batch(chunks), rows, prompt_rows

    def _find(self, request_id: str) -> Sequence | None:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    return seq
        return None

    def _find_seq_id(self, seq_id: int) -> Sequence | None:
        return next((s for s in self.running if s.seq_id == seq_id), None)


def warm_up_requests(vocab_size: int, max_num_seqs: int, budget: int, max_model_len: int,
                     max_tokens: int) -> list[Request]:
    """The synthetic burst of :meth:`BatchScheduler.warm_up`: ``min(max_num_seqs, 64)`` prompts of
    pseudo-random token ids whose lengths differ (a few tokens to a few hundred, most not a
    multiple of 16) and add up to about twice ``budget`` — so the loop runs prompt-only steps at
    the full budget, mixed steps (decodes beside prompt chunks), a short last prompt step and
    decode steps of several batch sizes — each asking 4 tokens past EOS, every other row greedy,
    the rest seeded with the default sampler chain.

    Args:
        vocab_size: token ids are drawn below it.
        max_num_seqs: the loop's sequence limit.
        budget: tokens one step may compute.
        max_model_len: no prompt is longer than this less 8 tokens.
        max_tokens: KV tokens the burst may hold at once (the longest prompts are dropped first).

    Returns:
        The requests (ids ``warm-up-<i>``); empty when not even the shortest prompt fits.
    """
    rng = random.Random(0)
    n = max(1, min(max_num_seqs, 64))
    longest = max(1, min(max_model_len - 8, 2 * budget // n + 64))
    lengths = [max(1, min(longest, 2 * budget // n + (37 * i) % 97 - 48)) for i in range(n)]
    if n > 1:
        lengths[-1] = min(lengths[-1], 7)  # a short prompt joining a step late
    while lengths and sum(m + 4 for m in lengths) > max_tokens:
        lengths.remove(max(lengths))
    return [Request(f"warm-up-{i}", [rng.randrange(vocab_size) for _ in range(m)],
                    SamplingParams(max_tokens=4, ignore_eos=True, **({"temperature": 0.0} if i % 2 == 0 else {"seed": i})))
            for i, m in enumerate(lengths)]
