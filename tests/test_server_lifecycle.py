"""`monobatch serve` as a process: SIGTERM shuts it down cleanly (short requests finish, long
ones are aborted and answered with a 503 — an error event in a stream, JSON otherwise — the port
is released), and bad flags fail at once with one line."""

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


def _post(base_url: str, body: dict, result: dict) -> None:
    try:
        result["response"] = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
    except httpx.HTTPError as exc:
        result["error"] = exc



def _start_in_flight(server, threads: list[threading.Thread]) -> None:
    """Start each request thread in turn, each once the server counts the ones before it as
    running or waiting (so all are in flight when the test signals the server)."""
    deadline = time.monotonic() + 30
    for count, t in enumerate(threads, 1):
        t.start()
        while True:
            m = server.metrics()
            if m["monobatch_num_requests_running"] + m["monobatch_num_requests_waiting"] >= count:
                break
            assert time.monotonic() < deadline

def test_sigterm_finishes_short_requests_aborts_long_ones_and_frees_the_port():
    """Case 5: within --shutdown-timeout a short request finishes; the long ones, streamed and
    not, are aborted before it ends and answered with an OpenAI-shaped 503; no traceback."""
    # 3 s of grace: the engine aborts what is left 1 s before it ends (ServerState.begin_shutdown),
    # so the short request has 2 s for its prefill and 4 steps beside two others; with 1.5 s it had
    # 0.75 s, which a loaded 2-core host used up to half of. The long ones (1,000 tokens, ~10 s at
    # -t 1 even on a fast host) are still running at the abort.
    server = start_server("-t", "1", "-c", "1024", "--shutdown-timeout", "3")
    port = int(server.base_url.rsplit(":", 1)[1])
    short, long_, plain = {}, {}, {}
    long_body = {"prompt": "Hello", "max_tokens": 1000, "ignore_eos": True}
    threads = [threading.Thread(target=_stream, args=(server.base_url, {"prompt": "Hello", "max_tokens": 4,
                                                                        "temperature": 0}, short)),
               threading.Thread(target=_stream, args=(server.base_url, long_body, long_)),
               threading.Thread(target=_post, args=(server.base_url, long_body, plain))]
    _start_in_flight(server, threads[::-1])  # the long ones first: the short one ends soon
    rc = server.stop(signal.SIGTERM, timeout=60)
    for t in threads:
        t.join(30)
    log = "".join(server.log)
    assert rc in (0, -signal.SIGTERM), log
    assert short["events"][-1] == "[DONE]" and short["events"][-2]["choices"][0]["finish_reason"] == "length"
    assert long_["events"][-1] == "[DONE]", long_  # ended in time, with the reason
    assert long_["events"][-2]["error"]["code"] == "server_shutting_down"
    r = plain["response"]
    assert r.status_code == 503 and r.headers["content-type"].startswith("application/json"), r.text
    assert r.json()["error"]["code"] == "server_shutting_down" and r.json()["error"]["type"] == "service_unavailable_error"
    assert "Traceback" not in log and "Cancel" not in log, log
    assert free_port_is_bindable(port)


@pytest.mark.parametrize("sigints,ignored", [(1, False), (2, False), (1, True)])
def test_ctrl_c_shuts_down_then_exits_130_and_a_second_one_forces_it(sigints, ignored):
    """Ctrl-C: the graceful shutdown (requests in flight answered with a 503 before the
    --shutdown-timeout ends), then exit 130 with one "interrupted" line, as every command on
    Ctrl-C (docs/cli.md) — also for a server that inherited SIGINT ignored (a shell's background
    job; uvicorn handles SIGINT anyway, and re-raising it after the shutdown did nothing: exit 0).
    A second Ctrl-C forces the exit at once (uvicorn's): the requests still in flight get the
    same OpenAI-shaped 503 now, not uvicorn's plain-text 500 of a cancelled task, and the app
    still shuts down (no traceback)."""
    grace = "1.5" if sigints == 1 else "60"
    server = start_server("-t", "1", "-c", "256", "--shutdown-timeout", grace, ignore_sigint=ignored)
    port = int(server.base_url.rsplit(":", 1)[1])
    streamed, plain = {}, {}
    long_body = {"prompt": "Hello", "max_tokens": 240, "ignore_eos": True}
    threads = [threading.Thread(target=_stream, args=(server.base_url, long_body, streamed)),
               threading.Thread(target=_post, args=(server.base_url, long_body, plain))]
    _start_in_flight(server, threads)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGINT)
    if sigints == 2:
        # the second Ctrl-C once the graceful shutdown has begun (uvicorn closed the listening socket),
        # not after a fixed sleep: two SIGINTs that arrive before Python runs the handler of the first
        # are handled once, and a busy host can hold the server's main thread back that long
        deadline = time.monotonic() + 30
        while not free_port_is_bindable(port):
            assert time.monotonic() < deadline, "the graceful shutdown did not begin:\n" + "".join(server.log)
            time.sleep(0.01)
        start = time.monotonic()  # the forced exit's time counts from the second Ctrl-C
        server.proc.send_signal(signal.SIGINT)
    rc = server.proc.wait(60)
    for t in threads:
        t.join(30)
    log = "".join(server.log)
    assert rc == 130 and log.rstrip().splitlines()[-1] == "monobatch serve: interrupted", log
    assert time.monotonic() - start < 10, log  # the forced exit does not wait out its 60 s of grace
    assert streamed["events"][-1] == "[DONE]", streamed
    assert streamed["events"][-2]["error"]["code"] == "server_shutting_down"
    r = plain["response"]
    assert r.status_code == 503 and r.headers["content-type"].startswith("application/json"), r.text
    assert r.json()["error"]["code"] == "server_shutting_down"
    assert "Traceback" not in log and "Cancel" not in log, log
    assert free_port_is_bindable(port)


@pytest.mark.parametrize("args,needle", [
    (["--max-queue", "-1"], "--max-queue"),
    (["--port", "70000"], "--port"),
    (["-m", "/nonexistent/model.gguf"], "model not found"),
    (["--reasoning-format", "xml"], "reasoning-format"),
    (["--max-model-len", "64", "-c", "128"], "not both"),
    (["--api-key", "clé"], "ASCII"),
    (["--logprobs", "2"], "unrecognized arguments: --logprobs"),  # a request's output option, not a default
])
def test_bad_flags_fail_before_listening(args, needle):
    assert_one_line_error(monobatch("serve", "--port", "0", *args), needle)


def test_stdout_carries_nothing_the_access_lines_go_to_stderr(tmp_path):
    """docs/cli.md: stdout carries results only; every diagnostic — the request log and uvicorn's
    access line beside it — is on stderr (uvicorn prints its access lines on stdout by default)."""
    out = (tmp_path / "stdout.txt").open("w")
    server = start_server("-t", "1", "-c", "256", "--log-level", "info", stdout=out)
    try:
        r = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 200
        deadline = time.monotonic() + 10
        while not any('"POST /v1/completions HTTP/1.1" 200' in line for line in server.log):
            assert time.monotonic() < deadline, "no access line on stderr:\n" + "".join(server.log)
            time.sleep(0.05)
    finally:
        server.stop(signal.SIGINT)
        out.close()
    assert (tmp_path / "stdout.txt").read_text() == ""
