"""The HTTP side's handle on the engine thread: submit requests, read their outputs, abort.

Everything here runs on the event loop. Outputs come from the engine thread in one batch per
step (``call_soon_threadsafe``) and are routed by request id to the queue of the HTTP request
that owns them (llama.cpp's ``server_response``). A :class:`ResponseReader` reads one HTTP
request's outputs — its ``n`` choices and prompts — and aborts whatever is unfinished when it is
closed (the client went away, the handler failed).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

from monobatch.engine.finish import RowOutput
from monobatch.engine.scheduler import BatchScheduler
from monobatch.engine.sequence import FinishReason, Request
from monobatch.server.engine_loop import EngineLoop
from monobatch.server.errors import APIError


class EngineFailed(Exception):
    """The engine aborted a request the client did not cancel (a step raised)."""


class EngineClient:
    """Submits requests to an :class:`EngineLoop` and routes its outputs.

    Args:
        scheduler: the decode loop; the client's :class:`EngineLoop` thread owns it from now on
            (call :meth:`start`).
        loop: the event loop that serves HTTP (outputs are routed on it).
        max_queue: sequences allowed to wait beyond ``max_num_seqs``; None = no limit.
        on_final: called on the event loop with every sequence's final output, its client's
            or not (metrics).
    """

    def __init__(self, scheduler: BatchScheduler, loop: asyncio.AbstractEventLoop, max_queue: int | None,
                 on_final: Callable[[RowOutput], None] | None = None) -> None:
        self.engine = EngineLoop(scheduler, self.deliver)
        self.loop = loop
        self.capacity = None if max_queue is None else scheduler.config.max_num_seqs + max_queue
        self._on_final = on_final
        self._queues: dict[str, asyncio.Queue[RowOutput]] = {}

    def start(self) -> None:
        """Start the engine thread."""
        self.engine.start()

    def stop(self) -> None:
        """Abort everything and end the engine thread."""
        self.engine.stop()

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

    async def submit(self, requests: list[Request]) -> "ResponseReader":
        """Add ``requests`` (all or none) and return their reader.

        Raises:
            APIError: 429 when ``--max-queue`` is full.
            InvalidRequestError: the engine refused one (the client's 400), before any output.
        """
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
        except BaseException:
            for request_id in ids:
                self._queues.pop(request_id, None)
            raise
        return ResponseReader(self, ids, outputs)

    def abort(self, request_ids: list[str]) -> None:
        """Stop routing ``request_ids`` and abort them on the engine."""
        for request_id in request_ids:
            self._queues.pop(request_id, None)
        self.engine.abort(request_ids)

    async def call(self, fn: Callable[[BatchScheduler], Any]) -> Any:
        """Run ``fn(scheduler)`` on the engine thread and await its result."""
        return await asyncio.wrap_future(self.engine.call(fn))


class ResponseReader:
    """The outputs of one HTTP request's sequences, in arrival order.

    Iterate for ``(choice index, RowOutput)``; always :meth:`close` (``async with``), which
    aborts the sequences that have not finished.
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
                    error = self.client.engine.last_error
                    raise EngineFailed(f"the engine failed while running this request: "
                                       f"{type(error).__name__ if error else 'aborted'}: {error or ''}")
            yield self.index[out.request_id], out

    def close(self) -> None:
        """Abort every sequence that has not finished (a no-op once all have)."""
        if self.unfinished:
            self.client.abort(sorted(self.unfinished))
            self.unfinished.clear()
