"""The HTTP side's handle on the engine thread: submit requests, read their outputs, abort.

Everything here runs on the event loop. Outputs come from the engine thread in one batch per
step (``call_soon_threadsafe``) and are routed by request id to the queue of the HTTP request
that owns them (llama.cpp's ``server_response``). A :class:`ResponseReader` reads one HTTP
request's outputs — its ``n`` choices and prompts — and aborts whatever is unfinished when it is
closed (the client went away, the handler failed).

A sequence the engine ends with ``abort`` without its client asking (a step raised, the server
is shutting down, the engine thread died) makes its reader raise :class:`EngineFailed`, which
carries the HTTP status to answer with (500, or 503 for the last two).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator, Callable

from monobatch.engine.finish import RowOutput
from monobatch.engine.scheduler import BatchScheduler
from monobatch.engine.sequence import FinishReason, Request
from monobatch.errors import InvalidRequestError
from monobatch.server.engine_loop import EngineLoop, EngineStopped
from monobatch.server.errors import APIError

#: Most sequences (prompts x n) one request may ask for; with ``--max-queue`` the limit is also
#: at most ``--max-num-seqs + --max-queue`` (what could ever be in flight at once).
MAX_SEQS_PER_REQUEST = 256


class EngineFailed(Exception):
    """The engine ended a request its client did not cancel.

    Args:
        status: the HTTP status to answer with: 500 (an engine step raised) or 503 (the server
            is shutting down, the engine thread stopped).
        message: one line for the client.
        code: the error's ``code`` (``server_shutting_down``, ``engine_stopped``) or None.
    """

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def shutting_down() -> EngineFailed:
    """The failure of a request the server's shutdown ends: 503 ``server_shutting_down``."""
    return EngineFailed(503, "the server is shutting down; retry on another server", "server_shutting_down")


class EngineClient:
    """Submits requests to an :class:`EngineLoop` and routes its outputs.

    Args:
        scheduler: the decode loop; the client's :class:`EngineLoop` thread owns it from now on
            (call :meth:`start`).
        loop: the event loop that serves HTTP (outputs are routed on it); construct the client
            on that loop's thread.
        max_queue: sequences allowed to wait beyond ``max_num_seqs``; None = no limit.
        on_final: called on the event loop with every sequence's final output, its client's
            or not (metrics).
    """

    def __init__(self, scheduler: BatchScheduler, loop: asyncio.AbstractEventLoop, max_queue: int | None,
                 on_final: Callable[[RowOutput], None] | None = None) -> None:
        self.engine = EngineLoop(scheduler, self.deliver, self._exited)
        self.loop = loop
        self.loop_thread = threading.get_ident()
        self.capacity = None if max_queue is None else scheduler.config.max_num_seqs + max_queue
        self.max_per_request = MAX_SEQS_PER_REQUEST if self.capacity is None else \
            min(MAX_SEQS_PER_REQUEST, self.capacity)
        self.failure: EngineFailed | None = None  # set once every request must fail (shutdown, engine gone)
        self._on_final = on_final
        self._queues: dict[str, asyncio.Queue[RowOutput]] = {}

    def start(self) -> None:
        """Start the engine thread."""
        self.engine.start()

    def stop(self) -> None:
        """Abort everything and end the engine thread (readers get a 503)."""
        if self.failure is None:
            self.failure = shutting_down()
        self.engine.stop()

    def stop_now(self) -> None:
        """A forced exit (a second Ctrl-C): every request in flight ends at once with the
        shutdown's 503, without waiting for the engine's next step, and the engine thread is told
        to stop (not waited for). Event loop only."""
        self.failure = shutting_down()
        self._end_all(None)
        self.engine.stop(timeout=0)

    @property
    def num_active(self) -> int:
        """Sequences submitted and not finished (running, waiting, or not yet admitted)."""
        return len(self._queues)

    def deliver(self, outputs: list[RowOutput]) -> None:
        """Engine thread -> event loop: hand one step's outputs over (thread-safe, non-blocking)."""
        self.loop.call_soon_threadsafe(self._route, outputs)

    def _route(self, outputs: list[RowOutput]) -> None:
        for out in outputs:
            if out.finished and self._on_final is not None:
                self._on_final(out)
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)
                if out.finished:
                    del self._queues[out.request_id]

    def _exited(self, error: BaseException | None) -> None:
        """Engine thread, once it has ended: fail what is still routed (on the event loop)."""
        try:
            self.loop.call_soon_threadsafe(self._end_all, error)
        except RuntimeError:  # the event loop is closed
            pass

    def _end_all(self, error: BaseException | None) -> None:
        if self.failure is None:
            reason = f": {type(error).__name__}: {error}" if error is not None else ""
            self.failure = EngineFailed(503, f"the engine has stopped{reason}", "engine_stopped")
        for request_id, q in list(self._queues.items()):  # nothing more will come for these
            q.put_nowait(RowOutput(request_id, finish_reason=FinishReason.ABORT))
        self._queues.clear()

    def fail_all(self, failure: EngineFailed) -> None:
        """End every request in flight with ``failure``: the engine aborts them (freeing their
        KV) and their readers raise it (shutdown: the clients get a 503, not a cut connection)."""
        self.failure = failure
        if self._queues:
            self.engine.abort(list(self._queues))

    def abort_error(self) -> EngineFailed:
        """What a reader raises for an ``abort`` its client did not ask for."""
        if self.failure is not None:
            return self.failure
        error = self.engine.last_error
        detail = f"{type(error).__name__}: {error}" if error is not None else "aborted"
        return EngineFailed(500, f"the engine failed while running this request: {detail}")

    def check_size(self, num_sequences: int, param: str) -> None:
        """Refuse a request that asks for more sequences (prompts x n) than one may.

        Raises:
            InvalidRequestError: over :attr:`max_per_request` (a 400: retrying cannot help).
        """
        if num_sequences > self.max_per_request:
            why = "" if self.capacity is None or self.capacity >= MAX_SEQS_PER_REQUEST else \
                " (--max-num-seqs + --max-queue: what this server can ever hold)"
            raise InvalidRequestError(f"{param}: this request asks for {num_sequences} sequences (prompts x n); "
                                      f"the limit is {self.max_per_request} per request{why}", param)

    async def submit(self, requests: list[Request]) -> "ResponseReader":
        """Add ``requests`` (all or none) and return their reader.

        Raises:
            InvalidRequestError: more sequences than one request may ask for (see
                :meth:`check_size`), or the engine refused one (the client's 400), before any output.
            APIError: 429 when ``--max-queue`` is full; 503 when the engine has stopped.
        """
        self.check_size(len(requests), "n")
        if self.failure is not None:
            raise APIError(self.failure.status, str(self.failure), code=self.failure.code)
        if self.capacity is not None and self.num_active + len(requests) > self.capacity:
            raise APIError(429, f"the server is busy ({self.num_active} sequences running or queued, "
                                f"limit {self.capacity}); retry later", code="rate_limit_exceeded")
        outputs: asyncio.Queue[RowOutput] = asyncio.Queue()
        ids = [r.request_id for r in requests]
        for request_id in ids:
            self._queues[request_id] = outputs
        try:
            await asyncio.wrap_future(self.engine.add(requests))
        except asyncio.CancelledError:  # the handler was cancelled: the add may still happen
            self.abort(ids)
            raise
        except EngineStopped as exc:
            self._forget(ids)
            raise APIError(503, "the engine has stopped", code="engine_stopped") from exc
        except BaseException:
            self._forget(ids)
            raise
        return ResponseReader(self, ids, outputs)

    def _forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._queues.pop(request_id, None)

    def abort(self, request_ids: list[str]) -> None:
        """Stop routing ``request_ids`` and abort them on the engine (event loop thread)."""
        self._forget(request_ids)
        self.engine.abort(request_ids)

    async def call(self, fn: Callable[[BatchScheduler], Any]) -> Any:
        """Run ``fn(scheduler)`` on the engine thread and await its result.

        Raises:
            APIError: 503 when the engine has stopped.
        """
        try:
            return await asyncio.wrap_future(self.engine.call(fn))
        except EngineStopped as exc:
            raise APIError(503, "the engine has stopped", code="engine_stopped") from exc


class ResponseReader:
    """The outputs of one HTTP request's sequences, in arrival order.

    Iterate for ``(choice index, RowOutput)``; always :meth:`close` (``async with``), which
    aborts the sequences that have not finished. An ``abort`` the client did not ask for raises
    :class:`EngineFailed`.
    """

    def __init__(self, client: EngineClient, request_ids: list[str], outputs: asyncio.Queue[RowOutput]) -> None:
        self.client = client
        self.index = {request_id: i for i, request_id in enumerate(request_ids)}
        self.unfinished = set(request_ids)
        self._outputs = outputs

    async def __aenter__(self) -> "ResponseReader":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    async def __aiter__(self) -> AsyncIterator[tuple[int, RowOutput]]:
        while self.unfinished:
            out = await self._outputs.get()
            if out.finished:
                self.unfinished.discard(out.request_id)
                if out.finish_reason is FinishReason.ABORT:
                    raise self.client.abort_error()
            yield self.index[out.request_id], out

    def close(self) -> None:
        """Abort every sequence that has not finished (a no-op once all have). Safe to call from
        any thread: off the event loop it is scheduled onto it."""
        if threading.get_ident() != self.client.loop_thread:
            self.client.loop.call_soon_threadsafe(self.close)
            return
        if self.unfinished:
            self.client.abort(sorted(self.unfinished))
            self.unfinished.clear()
