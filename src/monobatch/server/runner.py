"""Running the app: in the foreground (``monobatch serve``) or on a background thread
(``monobatch run``/``chat``, tests), from parsed flags or from an already-loaded model.

Both bind the listening socket first (so ``--port 0`` knows its port before the model loads),
then run uvicorn on it. In the foreground uvicorn handles SIGINT/SIGTERM: it stops accepting and
lets in-flight requests finish for ``shutdown_timeout`` seconds; shortly before that ends the
engine aborts what is left and those clients get a 503 (:meth:`ServerState.begin_shutdown`),
so uvicorn has nothing to cancel mid-response; then the app's shutdown stops the engine thread
and the socket is closed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from monobatch import defaults
from monobatch.errors import MonobatchError
from monobatch.server.app import create_app
from monobatch.server.state import ServerSettings, ServerState

if TYPE_CHECKING:
    from monobatch.loader import LoadedModel

SHUTDOWN_TIMEOUT = defaults.SERVER_SHUTDOWN_TIMEOUT
#: Most seconds a forced exit (a second SIGINT) waits for the requests in flight to send their 503.
FORCED_EXIT_DRAIN = 1.0


def settings_from_args(ns: argparse.Namespace) -> ServerSettings:
    """ServerSettings from parsed flags; flags a command lacks take their defaults."""
    from monobatch.cli.args import sampling_flags

    flags = sampling_flags(ns)
    flags.pop("logprobs", None)  # an output option of the request, not a sampling default
    return ServerSettings(served_model_names=tuple(getattr(ns, "served_model_name", None) or ()),
                          api_key=getattr(ns, "api_key", None), max_queue=getattr(ns, "max_queue", None),
                          reasoning_format=getattr(ns, "reasoning_format", None) or "separate",
                          sampling_flags=flags, allowed_origins=tuple(getattr(ns, "allowed_origins", None) or ()))


def app_from_args(ns: argparse.Namespace, loaded: "LoadedModel | None" = None) -> FastAPI:
    """The app for parsed ``add_model_args`` (+ sampling and server) flags.

    Args:
        ns: the flags; the model is loaded from them once the app starts, unless ...
        loaded: ... an already-loaded model is given (``run``/``chat`` reuse theirs).

    Raises:
        MonobatchError: a bad server flag (checked now; model flags are checked when loading).
    """
    from monobatch.cli.args import open_engine

    return create_app(settings_from_args(ns), lambda: open_engine(ns, loaded))


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0 = a free one).

    Raises:
        MonobatchError: the address cannot be bound (in use, not local, bad name).
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        raise MonobatchError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def _log_config() -> dict:
    """uvicorn's logging config with its access lines on stderr beside every other diagnostic
    (uvicorn's default prints them on stdout; monobatch's stdout carries results only, docs/cli.md)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config


def _config(app: FastAPI, log_level: str, shutdown_timeout: float, **kw) -> uvicorn.Config:
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout, lifespan="on",
                          log_config=_log_config(), **kw)


class _Server(uvicorn.Server):
    """uvicorn's server; its shutdown first tells the app (:meth:`ServerState.begin_shutdown`),
    and a forced exit (a second SIGINT) too (:meth:`ServerState.force_shutdown`)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.stopped_by: int | None = None  # the first signal that stopped the server
        state.on_fatal = lambda exc: setattr(self, "should_exit", True)

    def handle_exit(self, sig: int, frame) -> None:
        """uvicorn's signal handler (a second SIGINT forces the exit); on a forced exit the
        requests in flight get their 503 at once (on the event loop, which this handler
        interrupts), where uvicorn alone would cancel them into a plain-text 500."""
        if self.stopped_by is None:
            self.stopped_by = sig
        super().handle_exit(sig, frame)
        if self.force_exit:
            try:
                asyncio.get_running_loop().call_soon_threadsafe(self.state.force_shutdown)
            except RuntimeError:  # no loop runs (not serving yet, or already ended)
                pass

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Answer the requests in flight before the grace period ends, then uvicorn's shutdown.
        A forced exit waits up to :data:`FORCED_EXIT_DRAIN` seconds for their 503s to go out
        before the event loop ends (and cancels what is left), then runs the app's shutdown,
        which uvicorn skips then (its task cancelled, it would log a traceback): the engine
        thread was told to stop already, so that takes one engine step at most."""
        self.state.begin_shutdown(self.config.timeout_graceful_shutdown or 0.0)
        await super().shutdown(sockets)
        if not self.force_exit:
            return
        deadline = time.monotonic() + FORCED_EXIT_DRAIN
        while self.server_state.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await self.lifespan.shutdown()


def url_of(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _WhileReady(logging.Filter):
    """Lets uvicorn's own INFO lines (logger ``uvicorn.error``: "Started server process",
    "Application startup complete", "Shutting down", ...) through only while the model is ready.
    Before, "startup complete" would read as ready while the model still loads (monobatch says
    when it is: "model ... ready"); after a failed load the caller's one error line is the whole
    story (docs/cli.md, serve). Warnings and errors always pass."""

    def __init__(self, state: ServerState) -> None:
        super().__init__()
        self.state = state

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or (self.state.ready.is_set() and self.state.load_error is None)


def serve_foreground(app: FastAPI, sock: socket.socket, log_level: str = "info",
                     shutdown_timeout: float = SHUTDOWN_TIMEOUT) -> ServerState:
    """Serve until SIGINT/SIGTERM (or until loading the model fails) on the calling (main) thread;
    uvicorn's start-up and shutdown lines are printed only while the model is ready (:class:`_WhileReady`).

    Returns:
        The app's state (``load_error`` is set when the model could not be loaded; nothing has
        reported it: the caller does, in one line).
    """
    state: ServerState = app.state.monobatch
    server = _Server(_config(app, log_level, shutdown_timeout), state)  # (uvicorn's logging configured here)
    quiet = _WhileReady(state)
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(quiet)
    try:
        server.run(sockets=[sock])  # re-raises the signal that stopped it (KeyboardInterrupt for SIGINT)...
    finally:
        uvicorn_log.removeFilter(quiet)
    sock.close()
    if server.stopped_by is not None:  # ...unless it was inherited ignored: end as the signal's default would
        sig = signal.Signals(server.stopped_by)
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        signal.raise_signal(sig)
    return state


class ServerThread:
    """The app served by uvicorn on a background thread (no signal handling; call :meth:`stop`).

    Args:
        app: from :func:`create_app` or :func:`app_from_args`.
        host / port: where to listen (port 0 = a free port; see :attr:`base_url`).
        log_level: uvicorn's.

    Example::

        with ServerThread(app_from_args(ns, loaded)) as server:
            server.wait_ready()
            httpx.post(server.base_url + "/v1/chat/completions", json=...)
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 shutdown_timeout: float = SHUTDOWN_TIMEOUT) -> None:
        self.app = app
        self.sock = bind(host, port)
        self.base_url = url_of(self.sock)
        self.state: ServerState = app.state.monobatch
        self.server = _Server(_config(app, log_level, shutdown_timeout), self.state)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="monobatch-http", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        """Start serving; returns once uvicorn accepts connections (the model may still load)."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise MonobatchError("the server did not start")
            time.sleep(0.01)
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the model is loaded and the engine runs.

        Raises:
            MonobatchError: loading failed (the server has stopped) or ``timeout`` passed.
        """
        if not self.state.ready.wait(timeout):
            raise MonobatchError("the model did not load in time")
        if self.state.load_error is not None:
            raise self.state.load_error if isinstance(self.state.load_error, MonobatchError) else \
                MonobatchError(f"loading the model failed: {self.state.load_error}")

    def stop(self, timeout: float | None = 30.0) -> None:
        """Shut down (in-flight requests get ``shutdown_timeout``), stop the engine, free the port."""
        self.server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


logging.getLogger("monobatch.server").addHandler(logging.NullHandler())
