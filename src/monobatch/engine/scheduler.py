"""BatchScheduler: the one decode loop. Every client — CLI, server, Python API — drives it.

NOTE (the whole algorithm, after vLLM v1): there is no prefill or decode phase. Each step, each
running sequence's ``num_computed`` catches up with its ``num_tokens``: running decodes (one
token each) are planned first, then prompt chunks of at most ``prefill_chunk`` tokens fill the
remaining token budget, FIFO. A chunk that reaches a sequence's last token asks for logits, and
that sequence draws one token. Finished sequences release their KV in the same step.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Iterator

from monobatch.engine.batch import StepBatch
from monobatch.engine.engine import Engine
from monobatch.engine.finish import RequestMetrics, RowOutput
from monobatch.engine.sequence import FinishReason, Request, Sequence, SeqStatus
from monobatch.errors import ContextLengthError, InvalidRequestError
from monobatch.tokenizer import IncrementalDetokenizer


class BatchScheduler:
    """Continuous batching over an :class:`Engine` (FIFO admission, chunked prefill).

    Args:
        engine: the model, KV cache, sampler and finish step.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.config = engine.config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._done: list[RowOutput] = []  # outputs produced outside a forward (max_tokens 0, abort)

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Validate and queue a request.

        Raises:
            InvalidRequestError: an empty prompt, a token id outside the vocabulary, a bad
                sampling value. ContextLengthError: the prompt leaves no room to generate.
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
        request.params.check_vocab(vocab)
        detok = IncrementalDetokenizer(self.engine.tokenizer, request.prompt_ids, request.params.skip_special_tokens)
        seq = Sequence(request, detok)
        if request.params.max_tokens == 0:
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = FinishReason.LENGTH
            self._done.append(RowOutput(seq.request_id, finish_reason=FinishReason.LENGTH, num_prompt_tokens=n,
                                        metrics=RequestMetrics.of(seq)))
            return
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV; its final output (``abort``) comes from the next
        :meth:`step`. Returns False when the id is unknown or already finished."""
        for queue in (self.waiting, self.running):
            for seq in list(queue):
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.engine.kv.free(seq.seq_id)
                    seq.status, seq.finish_reason = SeqStatus.FINISHED, FinishReason.ABORT
                    self._done.append(RowOutput(seq.request_id, finish_reason=FinishReason.ABORT,
                                                num_prompt_tokens=len(seq.prompt_ids),
                                                num_output_tokens=len(seq.output_ids),
                                                metrics=RequestMetrics.of(seq)))
                    return True
        return False

    def preempt(self, request_id: str) -> bool:
        """Preempt by recompute: free a running sequence's KV and requeue it at the front.

        Its generated tokens and sampler state are kept, so when re-admitted it recomputes
        prompt + output and continues exactly where it stopped (a seeded draw depends only on
        seed and position). Returns False when the id is not running.
        """
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                self.engine.kv.free(seq.seq_id)
                seq.num_computed = 0
                seq.status = SeqStatus.WAITING
                self.waiting.appendleft(seq)
                return True
        return False

    def has_unfinished(self) -> bool:
        """True while any request is waiting, running, or has an undelivered final output."""
        return bool(self.waiting or self.running or self._done)

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> list[RowOutput]:
        """One iteration: admit, plan, forward + sample + finish, release finished KV."""
        outputs, self._done = self._done, []
        self._admit()
        planned = self._plan()
        if planned is None:
            return outputs
        batch, rows = planned
        try:
            outputs += self.engine.step(batch, rows)
        except BaseException:
            # Never leave KV and num_computed disagreeing: the step's sequences end (abort) and
            # free their KV; outputs already due are kept for the next step; the error
            # propagates to the client that drives the loop.
            self._done[:0] = outputs
            for c in batch.chunks:
                self._drop(c.seq_id)
            raise
        for seq in [s for s in self.running if s.is_finished]:
            self.running.remove(seq)
            self.engine.kv.free(seq.seq_id)
        return outputs

    def run(self, requests: Iterable[Request] = ()) -> Iterator[RowOutput]:
        """Add ``requests`` and step until nothing is left, yielding every output as produced."""
        for request in requests:
            self.add_request(request)
        while self.has_unfinished():
            yield from self.step()

    def _drop(self, seq_id: int) -> None:
        """Abort the running sequence ``seq_id`` after a failed step (KV freed, output queued)."""
        for seq in list(self.running):
            if seq.seq_id == seq_id:
                self.abort(seq.request_id)

    # -- phases of a step -------------------------------------------------------------------
    def _admit(self) -> None:
        """Move waiting sequences to running while ``max_num_seqs`` allows (FIFO)."""
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def _plan(self) -> tuple[StepBatch, list[Sequence]] | None:
        """First every decode (one token each), then prompt chunks within the token budget."""
        budget = self.config.token_budget
        chunks: list[tuple[int, list[int], int, bool]] = []
        rows: list[Sequence] = []
        decodes = [s for s in self.running if s.num_uncomputed == 1]
        prefills = [s for s in self.running if s.num_uncomputed > 1]
        for seq in decodes + prefills:
            n = min(seq.num_uncomputed, self.config.prefill_chunk, budget)
            if n <= 0:
                break
            start = seq.num_computed
            wants = start + n == seq.num_tokens
            chunks.append((seq.seq_id, seq.token_slice(start, start + n), start, wants))
            seq.num_computed += n
            budget -= n
            if wants:
                rows.append(seq)
        assert budget >= 0, "token budget overrun"
        if not chunks:
            return None
        return StepBatch.build(chunks, self.engine.device), rows
