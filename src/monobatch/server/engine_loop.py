"""The engine thread: the one owner of the BatchScheduler while a server runs.

HTTP handlers never touch the scheduler. They post typed messages on an input queue (add
requests, abort, run a function on the engine) and read :class:`RowOutput` s from a per-request
asyncio queue. The thread loops (llama.cpp's ``server_queue.start_loop``):

1. wait for a message when the scheduler is idle, else take whatever is queued without waiting;
2. apply the messages in order (adds and aborts, calls, stop), publish the stats;
3. ``scheduler.step()``;
4. hand the step's outputs to the event loop in one ``call_soon_threadsafe`` (the router puts
   each on its request's queue);
5. publish the scheduler's stats for ``/metrics`` (so a scrape never waits for a step).

torch releases the GIL inside every kernel, so HTTP, JSON and SSE work runs while the forward
computes; docs/adr/0003-server.md has the thread-versus-process measurement.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from monobatch.engine.finish import RowOutput
from monobatch.engine.scheduler import BatchScheduler
from monobatch.engine.sequence import Request

log = logging.getLogger("monobatch.server")


@dataclass(slots=True)
class AddRequests:
    """Add every request or none: on the first refusal the ones already added are aborted and
    the future carries the error (an InvalidRequestError becomes the client's 400)."""

    requests: list[Request]
    done: Future = field(default_factory=Future)


@dataclass(slots=True)
class AbortRequests:
    """Abort requests (client gone); their final ``abort`` outputs are dropped by the router."""

    request_ids: list[str]


@dataclass(slots=True)
class CallOnEngine:
    """Run ``fn(scheduler)`` on the engine thread between steps (prompt logprobs, stats)."""

    fn: Callable[[BatchScheduler], Any]
    done: Future = field(default_factory=Future)


@dataclass(slots=True)
class StopLoop:
    """Abort everything still running and end the thread."""


Message = AddRequests | AbortRequests | CallOnEngine | StopLoop


class EngineLoop:
    """Runs a BatchScheduler on its own thread.

    Args:
        scheduler: the decode loop; from now on only this thread touches it.
        deliver: called on the engine thread with each step's outputs; it must only hand them
            over (``loop.call_soon_threadsafe``), never block.

    Attributes:
        stats: the scheduler's latest stats (published after every step; see :func:`read_stats`).
        last_error: the last exception a step raised (its sequences end with ``abort``).
    """

    def __init__(self, scheduler: BatchScheduler, deliver: Callable[[list[RowOutput]], None]) -> None:
        self.scheduler = scheduler
        self._deliver = deliver
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="monobatch-engine", daemon=True)
        self.stats: dict[str, Any] = read_stats(scheduler)
        self.last_error: BaseException | None = None

    # -- the HTTP side's verbs (any thread) ---------------------------------------------------
    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def add(self, requests: list[Request]) -> Future:
        """Queue ``requests`` for admission; the future resolves (or fails) once they are added."""
        msg = AddRequests(list(requests))
        self._inbox.put(msg)
        return msg.done

    def abort(self, request_ids: list[str]) -> None:
        """Abort ``request_ids`` before the next step (KV freed within that step)."""
        self._inbox.put(AbortRequests(list(request_ids)))

    def call(self, fn: Callable[[BatchScheduler], Any]) -> Future:
        """Run ``fn(scheduler)`` on the engine thread; the future holds its result."""
        msg = CallOnEngine(fn)
        self._inbox.put(msg)
        return msg.done

    def stop(self, timeout: float | None = 10.0) -> None:
        """Abort what is running, end the thread and wait for it."""
        if self._thread.is_alive():
            self._inbox.put(StopLoop())
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """True while the thread runs."""
        return self._thread.is_alive()

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            msgs = self._take(block=not self.scheduler.has_unfinished())
            for msg in msgs:
                if isinstance(msg, StopLoop):
                    self._abort_all()
                    return
                self._apply(msg)
            if msgs:
                self.stats = read_stats(self.scheduler)
            if self.scheduler.has_unfinished():
                self._step()
                self.stats = read_stats(self.scheduler)

    def _take(self, block: bool) -> list[Message]:
        """Every queued message; when ``block``, wait for the first."""
        msgs = [self._inbox.get()] if block else []
        while True:
            try:
                msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                return msgs

    def _apply(self, msg: Message) -> None:
        if isinstance(msg, AddRequests):
            added: list[str] = []
            try:
                for request in msg.requests:
                    self.scheduler.add_request(request)
                    added.append(request.request_id)
            except BaseException as exc:  # noqa: BLE001 - the client gets it (a 400 or a 500)
                for request_id in added:
                    self.scheduler.abort(request_id)
                msg.done.set_exception(exc)
            else:
                msg.done.set_result(None)
        elif isinstance(msg, AbortRequests):
            for request_id in msg.request_ids:
                self.scheduler.abort(request_id)
        elif isinstance(msg, CallOnEngine):
            try:
                msg.done.set_result(msg.fn(self.scheduler))
            except BaseException as exc:  # noqa: BLE001
                msg.done.set_exception(exc)

    def _step(self) -> None:
        try:
            outputs = self.scheduler.step()
        except Exception as exc:  # noqa: BLE001 - the step's sequences end with abort; keep serving
            log.exception("engine step failed; its requests are aborted")
            self.last_error = exc
            return
        if outputs:
            try:
                self._deliver(outputs)
            except RuntimeError:  # the event loop is closed: the server is going away
                pass

    def _abort_all(self) -> None:
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
            self.scheduler.abort(seq.request_id)
        while self.scheduler.has_unfinished():  # collect the abort outputs (nothing to run)
            self.scheduler.step()
        self.stats = read_stats(self.scheduler)


#: Stats names and their values when the scheduler does not report them.
STAT_FIELDS = ("num_running", "num_waiting", "kv_usage", "kv_used_blocks", "kv_total_blocks", "kv_cached_blocks",
               "kv_used_bytes", "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_total",
               "generation_tokens_total", "num_preemptions", "num_requests_finished")


def read_stats(scheduler: BatchScheduler) -> dict[str, Any]:
    """The scheduler's counters and gauges as a dict of :data:`STAT_FIELDS` (engine thread only).

    ``BatchScheduler.stats()`` reports them; fields it lacks read 0 (running and waiting are
    always counted).
    """
    stats = getattr(scheduler, "stats", None)
    snapshot = stats() if callable(stats) else None
    out = {name: getattr(snapshot, name, 0) for name in STAT_FIELDS}
    if snapshot is None:
        out["num_running"], out["num_waiting"] = len(scheduler.running), len(scheduler.waiting)
    return out
