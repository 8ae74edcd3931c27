"""The server in-process, as `monobatch run`/`chat` will start it: the app factory over an
already-loaded model, uvicorn on a background thread, /health 503 while loading, a clean stop."""

from __future__ import annotations

import threading

import httpx
import pytest

from helpers import new_scheduler
from monobatch.errors import ModelNotFoundError
from monobatch.server import ServerSettings, ServerThread, app_from_args, create_app
from server_util import free_port_is_bindable

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_loading_then_ready_then_stopped(loaded):
    gate = threading.Event()

    def load():
        assert gate.wait(60)
        return new_scheduler(loaded, max_num_seqs=4)

    server = ServerThread(create_app(ServerSettings(), load)).start()
    port = int(server.base_url.rsplit(":", 1)[1])
    try:
        for path in ("/health", "/v1/models"):
            r = httpx.get(server.base_url + path, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        gate.set()
        server.wait_ready(60)
        assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        server.stop()
    assert not server.state.client.engine.alive
    assert free_port_is_bindable(port)


def test_load_failure_stops_the_server():
    def load():
        raise ModelNotFoundError("model not found: /nowhere.gguf")

    server = ServerThread(create_app(ServerSettings(), load)).start()
    with pytest.raises(ModelNotFoundError, match="nowhere"):
        server.wait_ready(60)
    server.stop()
    assert not server._thread.is_alive()


def test_app_from_args_reuses_a_loaded_model(loaded):
    """What `run`/`chat` do: parse flags, build the app over the model they hold, serve on a
    random loopback port, talk OpenAI over HTTP."""
    from monobatch.cli.main import build_parser

    ns = build_parser().parse_args(["serve", "-t", "1", "-c", "512", "--served-model-name", "local"])
    with ServerThread(app_from_args(ns, loaded)) as server:
        server.wait_ready(60)
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                       json={"model": "local", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "local"
