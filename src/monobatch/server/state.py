"""Server settings and the state one app holds: the loading model, then the engine client.

The model loads on a background thread after the server starts listening, so ``/health``
answers 503 while it loads (then 200) and generation endpoints answer 503 until it is ready.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from monobatch.chat_output import REASONING_FORMATS
from monobatch.engine.scheduler import BatchScheduler
from monobatch.errors import InvalidRequestError, require_api_key
from monobatch.server.client import EngineClient, shutting_down
from monobatch.server.errors import APIError
from monobatch.server.generation import max_prompt_chars
from monobatch.server.metrics import ServerMetrics

log = logging.getLogger("monobatch.server")

#: Largest request body accepted (413 beyond): a 128K-token prompt as JSON ids is ~1 MB.
MAX_BODY_BYTES = 32 * 2**20


@dataclass(slots=True)
class ServerSettings:
    """What ``monobatch serve`` (or an in-process caller) configures beyond the engine.

    Attributes:
        served_model_names: names the API answers to (``model`` field, ``/v1/models``); empty =
            the model's own name.
        api_key: when set, ``/v1/*``, ``/tokenize`` and ``/detokenize`` need ``Authorization:
            Bearer <key>``.
        max_queue: sequences that may wait beyond ``max_num_seqs`` before a 429; None = no limit.
        reasoning_format: ``separate`` (``<think>`` text -> ``reasoning_content``) or ``none``.
        sampling_flags: server-level sampling defaults (SamplingParams fields), below the
            request's own fields in precedence.
        max_body_bytes: larger request bodies get a 413 (by Content-Length, or counted while a
            chunked body arrives).
        allowed_origins: browser origins CORS lets call the API (``*`` = any); empty = no CORS
            headers (the default).
    """

    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    max_queue: int | None = None
    reasoning_format: str = "separate"
    sampling_flags: dict[str, Any] = field(default_factory=dict)
    max_body_bytes: int = MAX_BODY_BYTES
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.served_model_names = tuple(self.served_model_names)
        self.allowed_origins = tuple(self.allowed_origins)
        if self.max_queue is not None and self.max_queue < 0:
            raise InvalidRequestError("--max-queue must be >= 0", "max_queue")
        if self.reasoning_format not in REASONING_FORMATS:
            raise InvalidRequestError(f"--reasoning-format must be one of {', '.join(REASONING_FORMATS)}",
                                      "reasoning_format")
        require_api_key(self.api_key)


class ServerState:
    """The app's model and engine, once loaded (``app.state.monobatch``).

    Args:
        settings: the server settings.
        load: builds the BatchScheduler (loads the model); runs on a background thread.

    Attributes:
        on_fatal: called (on the event loop) with the error when loading fails; the runner
            uses it to stop the server, and its caller reports the error (``serve``: in one line;
            :meth:`ServerThread.wait_ready` raises it). Unset, the error is logged instead.
        load_error: that error, if any.
        ready: a threading.Event set once loading has ended (check ``load_error``).
    """

    def __init__(self, settings: ServerSettings, load: Callable[[], BatchScheduler]) -> None:
        self.settings = settings
        self._load = load
        self.client: EngineClient | None = None
        self.scheduler: BatchScheduler | None = None
        self.load_error: BaseException | None = None
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.metrics = ServerMetrics(self._stats)
        self.names: tuple[str, ...] = settings.served_model_names
        self.ready = threading.Event()  # set once loading ends, either way (any thread may wait)
        self.max_prompt_chars = 0  # longer prompt text cannot fit the context (set once loaded)
        self.closing = False  # SIGINT/SIGTERM received: new requests get a 503

    # -- lifecycle (event loop) ---------------------------------------------------------------
    def start_loading(self) -> None:
        """Load on a daemon thread (shutting down never waits for a load in progress)."""
        loop = asyncio.get_running_loop()

        def work() -> None:
            try:
                scheduler = self._load()
                scheduler.warm_up()  # graphs captured and kernels compiled now, not in the first requests' TTFT
                chars = max_prompt_chars(scheduler.engine.tokenizer, scheduler.engine.max_model_len)
            except BaseException as exc:  # noqa: BLE001 - reported to the runner, which exits
                loop.call_soon_threadsafe(self._failed, exc)
            else:
                loop.call_soon_threadsafe(self._loaded, scheduler, chars, loop)

        threading.Thread(target=work, name="monobatch-load", daemon=True).start()

    def _loaded(self, scheduler: BatchScheduler, chars: int, loop: asyncio.AbstractEventLoop) -> None:
        self.scheduler = scheduler
        self.max_prompt_chars = chars
        self.names = self.names or (scheduler.engine.loaded.name,)
        self.client = EngineClient(scheduler, loop, self.settings.max_queue, self.metrics.observe_final)
        self.client.start()
        self.ready.set()
        log.info("model %s ready (context %d tokens)", self.names[0], scheduler.engine.max_model_len)

    def _failed(self, exc: BaseException) -> None:
        self.load_error = exc
        self.ready.set()
        if self.on_fatal is not None:
            self.on_fatal(exc)
        else:  # nobody to stop the server and report it: at least the log says why it stays 503
            log.error("loading the model failed: %s", exc)

    def begin_shutdown(self, grace: float) -> None:
        """SIGINT/SIGTERM (event loop): requests in flight get most of ``grace`` seconds to
        finish; then the engine aborts the rest and their clients get a 503 (code
        ``server_shutting_down``: a JSON error, or an error event before ``[DONE]``) before
        uvicorn's grace period ends and it would cancel them mid-response."""
        self.closing = True
        if self.client is None:
            return
        margin = min(1.0, grace / 2)
        asyncio.get_running_loop().call_later(grace - margin, self.client.fail_all, shutting_down())

    def force_shutdown(self) -> None:
        """A forced exit (a second SIGINT; event loop): the requests in flight get their 503 now
        (``EngineClient.stop_now``), not the grace period's, and the engine thread stops."""
        self.closing = True
        if self.client is not None:
            self.client.stop_now()

    def shutdown(self) -> None:
        """Abort what still runs, stop the engine thread, and let go of the engine: FastAPI keeps
        an app's endpoint functions (and so this state) in module-level caches, so a stopped
        in-process server would otherwise hold its weights' engine and KV pool for the life of
        the process."""
        if self.client is not None:
            self.client.stop()
        self.client = self.scheduler = None

    # -- for handlers ---------------------------------------------------------------------------
    def require_client(self) -> EngineClient:
        """The engine client. Raises APIError 503 while loading, once shutting down, or after
        the engine stopped."""
        if self.client is None:
            raise APIError(503, "the model is loading; retry when GET /health answers 200", code="model_loading")
        if self.closing:
            raise APIError(503, "the server is shutting down; retry on another server", code="server_shutting_down")
        if self.client.failure is not None:
            raise APIError(self.client.failure.status, str(self.client.failure), code=self.client.failure.code)
        if not self.client.engine.alive:
            raise APIError(503, "the engine has stopped", code="engine_stopped")
        return self.client

    def check_model(self, name: str | None) -> str:
        """The served name a request's ``model`` refers to. Raises APIError 404 for another name."""
        if name in (None, ""):
            return self.names[0]
        if name not in self.names:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {', '.join(self.names)}",
                           param="model", code="model_not_found")
        return name

    @property
    def tokenizer(self):
        """The model's tokenizer (ready state only)."""
        return self.scheduler.engine.tokenizer

    @property
    def grammars(self):
        """The engine's structured-output compiler (ready state only)."""
        return self.scheduler.engine.grammars

    @property
    def max_model_len(self) -> int:
        """The engine's context length."""
        return self.scheduler.engine.max_model_len

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """The model's generation config (the third precedence level)."""
        return self.scheduler.engine.loaded.generation_defaults

    @property
    def sampling_flags(self) -> dict[str, Any]:
        """Server-level sampling defaults."""
        return self.settings.sampling_flags

    def _stats(self) -> dict | None:
        return self.client.engine.stats if self.client is not None else None
