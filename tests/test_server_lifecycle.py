"""`monobatch serve` as a process: SIGTERM shuts it down cleanly (short requests finish, long
ones are aborted, the port is released), and bad flags fail at once with one line."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from server_util import free_port_is_bindable, sse_events, start_server
from test_cli import assert_one_line_error, monobatch


def _stream(base_url: str, body: dict, result: dict) -> None:
    try:
        with httpx.stream("POST", base_url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            result["events"] = sse_events(r.iter_lines())
    except httpx.HTTPError as exc:  # the connection cut mid-stream
        result["error"] = exc


def test_sigterm_finishes_short_requests_aborts_long_ones_and_frees_the_port():
    server = start_server("-t", "1", "-c", "256", "--shutdown-timeout", "1.5")
    port = int(server.base_url.rsplit(":", 1)[1])
    short, long_ = {}, {}
    threads = [threading.Thread(target=_stream, args=(server.base_url, body, out)) for body, out in (
        ({"prompt": "Hello", "max_tokens": 4, "temperature": 0}, short),
        ({"prompt": "Hello", "max_tokens": 240, "ignore_eos": True}, long_))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while server.metrics()["monobatch_num_requests_running"] + server.metrics()["monobatch_num_requests_waiting"] < 2:
        assert time.monotonic() < deadline
    rc = server.stop(signal.SIGTERM, timeout=60)
    for t in threads:
        t.join(30)
    assert rc in (0, -signal.SIGTERM), "".join(server.log)
    assert short["events"][-1] == "[DONE]" and short["events"][-2]["choices"][0]["finish_reason"] == "length"
    assert "error" in long_ or long_["events"][-1] != "[DONE]"  # cut off after the grace period
    assert "Traceback" not in "".join(server.log)
    assert free_port_is_bindable(port)


@pytest.mark.parametrize("args,needle", [
    (["--max-queue", "-1"], "--max-queue"),
    (["--port", "70000"], "--port"),
    (["-m", "/nonexistent/model.gguf"], "model not found"),
    (["--reasoning-format", "xml"], "reasoning-format"),
    (["--max-model-len", "64", "-c", "128"], "not both"),
])
def test_bad_flags_fail_before_listening(args, needle):
    assert_one_line_error(monobatch("serve", "--port", "0", *args), needle)
