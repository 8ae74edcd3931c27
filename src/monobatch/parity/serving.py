"""The machinery of ``monobatch parity``'s HTTP doors: a fresh engine behind the app
``monobatch serve`` builds, served in this process with a finish recorder on its scheduler
(:func:`serving`, :class:`Server`, :class:`Recorder`), and the ``run`` door's subprocess
(:func:`run_cli_door`)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from monobatch.engine.engine import EngineConfig
    from monobatch.engine.scheduler import FinishedRequest
    from monobatch.loader import LoadedModel

#: Seconds for one HTTP request, a server to load, the ``run`` subprocess.
HTTP_TIMEOUT = 600.0
LOAD_TIMEOUT = 300.0
RUN_TIMEOUT = 600.0


# -- capturing what the engine generated ---------------------------------------------------------------
class Recorder:
    """A finish observer: keeps every finished request (engine thread) for the parity thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list["FinishedRequest"] = []

    def add(self, record: "FinishedRequest") -> None:
        """Keep ``record`` (called by the scheduler's finish hook on the engine thread)."""
        with self._lock:
            self._records.append(record)

    def mark(self) -> int:
        """A position: :meth:`since` returns what finished after it."""
        with self._lock:
            return len(self._records)

    def since(self, mark: int) -> list["FinishedRequest"]:
        """The requests that finished after :meth:`mark` returned ``mark``, in finishing order."""
        with self._lock:
            return list(self._records[mark:])


@dataclass(slots=True)
class Server:
    """A running in-process server door: its URL, the recorder of what its engine finished, and
    its KV storage (``paged`` or ``dense``)."""

    base_url: str
    recorder: Recorder
    kv_storage: str

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{sample name: value}`` (unlabelled samples)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.base_url + "/metrics", timeout=HTTP_TIMEOUT).text
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
                if not s.labels}

    def settled_metrics(self, finished: int, timeout: float = 60.0) -> dict[str, float]:
        """``/metrics`` once the engine has published the stats of the step that finished the
        ``finished``-th request (stats are published just after the outputs are handed over)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m.get("monobatch_num_requests_running", 1) == 0 and m.get("monobatch_num_requests_waiting", 1) == 0
            if idle and m.get("monobatch_num_requests_finished_total", 0) >= finished:
                return m
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server's metrics did not settle: {m}")
            time.sleep(0.02)

    def chat(self, message: str, fields: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed chat completion with ``return_token_ids``; raises on an error answer."""
        import httpx

        from monobatch.cli.http_client import refusal

        body = {"messages": [{"role": "user", "content": message}], **fields, "return_token_ids": True}
        r = httpx.post(self.base_url + "/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT)
        if r.status_code != 200:
            raise refusal(r, self.base_url, has_key=False)
        return r.json()


@contextmanager
def serving(loaded: "LoadedModel", config: "EngineConfig") -> Iterator[Server]:
    """A fresh engine over ``loaded`` behind the app ``monobatch serve`` builds, served on a
    background thread (127.0.0.1, a free port), its finished requests recorded; the engine's
    memory is released when the block ends."""
    from monobatch.engine.engine import Engine
    from monobatch.engine.scheduler import BatchScheduler
    from monobatch.server import ServerSettings, ServerThread, create_app

    recorder = Recorder()

    def load() -> BatchScheduler:
        scheduler = BatchScheduler(Engine(loaded, config))
        scheduler.add_finish_observer(recorder.add)
        return scheduler

    server = ServerThread(create_app(ServerSettings(), load)).start()
    try:
        server.wait_ready(LOAD_TIMEOUT)
        yield Server(server.base_url, recorder, config.kv_storage)
    finally:
        server.stop()  # the stopped state lets go of its engine (ServerState.shutdown)
        release_memory()


def run_cli_door(base_url: str, message: str, fields: dict[str, Any], timeout: float = RUN_TIMEOUT) -> str:
    """``python -m monobatch run --server-base base_url`` with ``fields`` as flags; its stdout.

    The child is ``sys.executable -m monobatch`` with this process's ``monobatch`` package first
    on ``PYTHONPATH``, so it works where the package is not installed.

    Args:
        fields: request fields (SamplingParams names, the ``run`` flags' names with dashes):
            ``True`` -> a bare flag, ``False`` -> none, ``logit_bias`` -> ``--logit-bias=ID=BIAS``
            each, anything else ``--name-with-dashes=value``.

    Returns:
        The reply as printed, reasoning text included (``--reasoning-format none``; the final
        newline ``run`` adds removed).

    Raises:
        RuntimeError: the command failed (its last stderr line), or ran past ``timeout`` seconds.
    """
    import monobatch

    # --reasoning-format none: a <think> block's text stays in the reply (stdout), not on stderr
    args = [sys.executable, "-m", "monobatch", "run", "--server-base", base_url, "--reasoning-format", "none",
            f"--prompt={message}"]
    for name, value in fields.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args += [flag] if value else []  # the boolean flags are off by default
        elif name == "logit_bias":
            args += [f"--logit-bias={k}={v}" for k, v in value.items()]
        elif isinstance(value, dict):  # a JSON-valued flag (--json-schema)
            args.append(f"{flag}={json.dumps(value)}")
        else:
            args.append(f"{flag}={value}")  # one argument: a negative value is not taken for a flag
    package_root = str(Path(monobatch.__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k != "MONOBATCH_API_KEY"}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")])),
               PYTHONIOENCODING="utf-8", TOKENIZERS_PARALLELISM="false")
    try:
        res = subprocess.run(args, capture_output=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"monobatch run did not finish in {timeout:g} s") from None
    stderr = res.stderr.decode("utf-8", "replace").strip()
    if res.returncode != 0:
        last = stderr.splitlines()[-1] if stderr else "no message"
        raise RuntimeError(f"monobatch run exited {res.returncode}: {last}")
    return res.stdout.decode("utf-8").removesuffix("\n")


def release_memory() -> None:
    """Collect the engines of finished doors (reference cycles included) and give their cached
    CUDA memory back, so that the next door's engine finds it free."""
    gc.collect()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
