"""Real `monobatch serve` processes for the server tests, started once per session.

Each server runs on 127.0.0.1 with a free port (``--port 0``; the port is read from its
"listening on" line), one CPU thread (the test process and the server share 2 cores) and a small
context. ``shared_server(name, args)`` starts a server on first use and returns the same one after;
all are stopped (SIGTERM) when the session ends.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT = 240.0


@dataclass
class Server:
    """A running server process."""

    proc: subprocess.Popen
    base_url: str
    log: list[str] = field(default_factory=list)
    health_while_loading: list[httpx.Response] = field(default_factory=list)

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.base_url + path, timeout=120, **kw)

    def post(self, path: str, body=None, **kw) -> httpx.Response:
        kw.setdefault("timeout", 120)
        if body is not None:
            kw["json"] = body
        return httpx.post(self.base_url + path, **kw)

    def metrics(self, headers=None) -> dict[str, float]:
        """/metrics as ``{sample name{labels}: value}`` via prometheus_client's parser."""
        from prometheus_client.parser import text_string_to_metric_families

        text = self.get("/metrics", headers=headers).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def wait_idle(self, timeout: float = 30.0, headers=None) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits and no KV block is referenced."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics(headers)
            if m["monobatch_num_requests_running"] == 0 and m["monobatch_num_requests_waiting"] == 0 \
                    and m["monobatch_kv_cache_used_blocks"] == 0:
                return m
            assert time.monotonic() < deadline, f"server not idle: {m}"
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(*args: str, env: dict | None = None, wait_ready: bool = True, ignore_sigint: bool = False,
                 stdout=subprocess.DEVNULL) -> Server:
    """Start ``python -m monobatch serve --port 0 ARGS`` and wait for its port (and /health 200).
    ``ignore_sigint``: the server inherits SIGINT ignored, as a shell's background job does;
    ``stdout``: where its stdout goes (a file to read it back)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "monobatch", "serve", "--port", "0", "--no-progress",
                             "--log-level", "warning", *args],
                            stdout=stdout, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None)
    log: list[str] = []
    url: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stderr:
            log.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                url.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    ready.wait(STARTUP_TIMEOUT)
    assert url, "server did not start:\n" + "".join(log)
    server = Server(proc, url[0], log)
    if wait_ready:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            assert proc.poll() is None, "server exited:\n" + "".join(log)
            r = httpx.get(server.base_url + "/health", timeout=30)
            if r.status_code == 200:
                break
            server.health_while_loading.append(r)
            assert time.monotonic() < deadline, "server did not become ready:\n" + "".join(log)
            time.sleep(0.05)
    return server


_SHARED: dict[str, Server] = {}


def shared_server(name: str, *args: str) -> Server:
    """The session's server called ``name`` (started with ``args`` on first use)."""
    if name not in _SHARED:
        _SHARED[name] = start_server(*args)
    server = _SHARED[name]
    assert server.proc.poll() is None, "shared server died:\n" + "".join(server.log)
    return server


@atexit.register
def _stop_all() -> None:
    for server in _SHARED.values():
        server.stop()


def sse_events(lines) -> list:
    """The JSON payloads of an SSE stream, then the literal "[DONE]" (if sent)."""
    events = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def free_port_is_bindable(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def assert_400_naming(server: Server, path: str, body: dict, param: str) -> dict:
    """``body`` is an OpenAI-shaped JSON 400 (before any SSE byte when streamed) whose ``param``
    or message names ``param``; the server then still answers a small completion. Returns the error."""
    resp = server.post(path, body)
    assert resp.status_code == 400, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and param in (err.get("param") or "") + err["message"], err
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200
    return err
