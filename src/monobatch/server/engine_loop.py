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

However the thread ends — :class:`StopLoop`, or an exception escaping the loop — every message
still queued, and every one posted later, is refused (its future fails with
:class:`EngineStopped`), and ``on_exit`` tells the client, which ends every request it still
routes (a 503). Nothing waits forever on a dead engine.

torch releases the GIL inside every kernel, so HTTP, JSON and SSE work runs while the forward
computes; docs/adr/0003-server.md has the thread-versus-process measurement.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
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
    """Abort requests (client gone, shutdown); their final ``abort`` outputs are delivered (the
    router drops those of requests whose client has gone)."""

    request_ids: list[str]


@dataclass(slots=True)
class CallOnEngine:
    """Run ``fn(scheduler)`` on the engine thread between steps (prompt logprobs, stats)."""

    fn: Callable[[BatchScheduler], Any]
    done: Future = field(default_factory=Future)


@dataclass(slots=True)
class StopLoop:
    """Abort everything still running (delivering the ``abort`` outputs) and end the thread;
    messages after it are refused (:class:`EngineStopped`)."""


Message = AddRequests | AbortRequests | CallOnEngine | StopLoop


class EngineStopped(RuntimeError):
    """The engine thread has ended (shutdown, or it died): a message posted to it is refused."""


class EngineLoop:
    """Runs a BatchScheduler on its own thread.

    Args:
        scheduler: the decode loop; from now on only this thread touches it.
        deliver: called on the engine thread with each step's outputs; it must only hand them
            over (``loop.call_soon_threadsafe``), never block.
        on_exit: called on the engine thread once it has ended, with the exception that killed
            it (None after :meth:`stop`); it must only hand that over, like ``deliver``.

    Attributes:
        stats: the scheduler's latest stats (published after every step; see :func:`read_stats`).
        last_error: the last exception a step raised (its sequences end with ``abort``).
        exit_error: the exception that ended the thread, if one did.
    """

    def __init__(self, scheduler: BatchScheduler, deliver: Callable[[list[RowOutput]], None],
                 on_exit: Callable[[BaseException | None], None] | None = None) -> None:
        self.scheduler = scheduler
        self._deliver = deliver
        self._on_exit = on_exit
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._pending: deque[Message] = deque()  # taken from the inbox, not applied yet
        self._lock = threading.Lock()  # orders posting against closing
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="monobatch-engine", daemon=True)
        self.stats: dict[str, Any] = read_stats(scheduler)
        self.last_error: BaseException | None = None
        self.exit_error: BaseException | None = None

    # -- the HTTP side's verbs (any thread) ---------------------------------------------------
    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def add(self, requests: list[Request]) -> Future:
        """Queue ``requests`` for admission; the future resolves (or fails) once they are added,
        and fails with :class:`EngineStopped` once the thread has ended."""
        return self._post(AddRequests(list(requests))).done

    def abort(self, request_ids: list[str]) -> None:
        """Abort ``request_ids`` before the next step (KV freed within that step); their final
        ``abort`` outputs are delivered like any other output."""
        self._post(AbortRequests(list(request_ids)))

    def call(self, fn: Callable[[BatchScheduler], Any]) -> Future:
        """Run ``fn(scheduler)`` on the engine thread; the future holds its result (or
        :class:`EngineStopped`)."""
        return self._post(CallOnEngine(fn)).done

    def stop(self, timeout: float | None = 10.0) -> None:
        """Abort what is running (its ``abort`` outputs are delivered), end the thread, wait."""
        if self._thread.is_alive():
            self._post(StopLoop())
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """True while the thread runs."""
        return self._thread.is_alive() and not self._closed

    def _post(self, msg: Message) -> Message:
        with self._lock:
            if not self._closed:
                self._inbox.put(msg)
                return msg
        _refuse(msg)
        return msg

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        error: BaseException | None = None
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - reported to the client, which fails every request
            error = self.exit_error = exc
            log.critical("the engine thread died; every request in flight fails with a 503", exc_info=exc)
        finally:
            with self._lock:
                self._closed = True
            for msg in [*self._pending, *self._take(block=False)]:  # posted before the close
                _refuse(msg)
            self._pending.clear()
            if self._on_exit is not None:
                self._on_exit(error)

    def _serve(self) -> None:
        while True:
            self._pending.extend(self._take(block=not self.scheduler.has_unfinished()))
            applied = bool(self._pending)
            while self._pending:
                msg = self._pending.popleft()
                if isinstance(msg, StopLoop):
                    self._abort_all()
                    return
                self._apply(msg)
            if applied:
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
        self._hand_over(outputs)

    def _hand_over(self, outputs: list[RowOutput]) -> None:
        if outputs:
            try:
                self._deliver(outputs)
            except RuntimeError:  # the event loop is closed: the server is going away
                pass

    def _abort_all(self) -> None:
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
            self.scheduler.abort(seq.request_id)
        outputs: list[RowOutput] = []
        while self.scheduler.has_unfinished():  # collect the abort outputs (nothing to run)
            outputs += self.scheduler.step()
        self._hand_over(outputs)
        self.stats = read_stats(self.scheduler)


def _refuse(msg: Message) -> None:
    """Fail the future of a message the ended thread will never apply."""
    if isinstance(msg, (AddRequests, CallOnEngine)) and not msg.done.done():
        msg.done.set_exception(EngineStopped("the engine has stopped"))


#: The stats ``/metrics`` shows (:class:`monobatch.engine.metrics.SchedulerStats` fields).
STAT_FIELDS = ("num_running", "num_waiting", "kv_usage", "kv_used_blocks", "kv_total_blocks", "kv_cached_blocks",
               "kv_used_bytes", "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_total",
               "generation_tokens_total", "num_preemptions", "num_requests_finished", "paged_attention_calls")


def read_stats(scheduler: BatchScheduler) -> dict[str, Any]:
    """The scheduler's counters and gauges as a dict of :data:`STAT_FIELDS` (engine thread only)."""
    snapshot = scheduler.stats()
    return {name: getattr(snapshot, name) for name in STAT_FIELDS}
