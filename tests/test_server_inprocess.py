"""The server in-process, as `monobatch run`/`chat` will start it: the app factory over an
already-loaded model, uvicorn on a background thread, /health 503 while loading, a clean stop,
and an engine thread that dies under its requests (every one answered with a 503)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from helpers import new_scheduler
from monobatch.errors import ModelNotFoundError
from monobatch.server import ServerSettings, ServerThread, app_from_args, create_app
from monobatch.server.engine_loop import EngineStopped
from server_util import free_port_is_bindable, sse_events

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
        client = server.state.client
    finally:
        server.stop()
    assert not client.engine.alive
    assert server.state.client is None and server.state.scheduler is None  # the engine can be freed
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


class _Boom(BaseException):
    """Not an Exception: escapes the engine loop's per-step handler and kills the thread."""


def test_engine_thread_death_fails_every_request_with_503(loaded):
    """Case 7: the engine thread dies with a streamed and a non-streamed request in flight: both
    end (an error event then [DONE]; a JSON 503), nothing hangs, later requests get a 503 and a
    message posted to the dead thread fails at once."""
    boom = threading.Event()

    def load():
        scheduler = new_scheduler(loaded, max_num_seqs=4)
        step = scheduler.step

        def failing_step():
            if boom.is_set():
                raise _Boom("the device went away")
            return step()

        scheduler.step = failing_step
        return scheduler

    body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True}
    plain = {}
    with ServerThread(create_app(ServerSettings(), load)) as server:
        server.wait_ready(60)
        url = server.base_url
        waiter = threading.Thread(target=lambda: plain.setdefault(
            "r", httpx.post(url + "/v1/completions", json=body, timeout=60)))
        waiter.start()
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)  # the stream is generating
            deadline = time.monotonic() + 30
            while server.state.client.num_active < 2:  # the non-streamed one is in flight too
                assert time.monotonic() < deadline
                time.sleep(0.01)
            boom.set()
            events = sse_events([first, *lines])
        waiter.join(60)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_stopped"
        r = plain["r"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped", r.text
        again = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_stopped"
        assert httpx.get(url + "/health", timeout=30).status_code == 503
        with pytest.raises(EngineStopped):
            server.state.client.engine.call(lambda s: None).result(5)
        assert server.state.client.num_active == 0


def test_engine_loop_stop_delivers_the_aborts_and_refuses_later_messages(loaded):
    """Case 7: StopLoop aborts what runs and delivers those outputs (nothing is dropped); a
    message posted with or after it fails at once instead of waiting forever."""
    from monobatch.engine.params import SamplingParams
    from monobatch.engine.sequence import FinishReason, Request
    from monobatch.server.engine_loop import EngineLoop, StopLoop

    delivered, exited = [], []
    engine = EngineLoop(new_scheduler(loaded, max_num_seqs=2), delivered.extend, exited.append)
    engine.start()
    engine.add([Request("a", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))]).result(30)
    engine._post(StopLoop())
    late_add = engine.add([Request("b", [1, 2], SamplingParams(max_tokens=2))])
    late_call = engine.call(lambda s: 1)
    engine._thread.join(30)
    assert not engine.alive and exited == [None]
    for future in (late_add, late_call):
        with pytest.raises(EngineStopped):
            future.result(5)
    final = [o for o in delivered if o.request_id == "a" and o.finished]
    assert [o.finish_reason for o in final] == [FinishReason.ABORT]
    assert engine.stats["num_running"] == 0 and engine.stats["kv_used_blocks"] == 0


def _lines(caplog, needle: str, timeout: float = 30.0) -> list:
    """The ``monobatch.server`` records containing ``needle`` (waiting up to ``timeout`` for one)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in caplog.records if r.name == "monobatch.server" and needle in r.getMessage()]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def test_one_log_line_per_request(loaded, caplog):
    """`serve` logs one INFO line per request, as vLLM and llama-server do: finished (id,
    endpoint, stream, prompt and completion tokens, finish reasons, TTFT and total ms), refused
    (status and message, no traceback), aborted (the client disconnected, streamed or not)."""
    import logging
    import re

    caplog.set_level(logging.INFO, logger="monobatch.server")
    chat = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0}
    with ServerThread(create_app(ServerSettings(), lambda: new_scheduler(loaded, max_num_seqs=4))) as server:
        server.wait_ready(60)
        url = server.base_url
        done = httpx.post(url + "/v1/chat/completions", json={**chat, "max_tokens": 3, "n": 2}, timeout=60).json()
        [line] = _lines(caplog, done["id"])
        assert line.levelno == logging.INFO and line.exc_info is None
        fields = dict(re.findall(r"(\w+)=(\S+)", line.getMessage()))
        assert f"{done['id']} /v1/chat/completions finished:" in line.getMessage()
        assert fields["stream"] == "false" and fields["finish_reason"] == "length,length"
        assert int(fields["prompt_tokens"]) == done["usage"]["prompt_tokens"]
        assert int(fields["completion_tokens"]) == done["usage"]["completion_tokens"] == 6
        assert 0 < float(fields["ttft_ms"]) <= float(fields["total_ms"])

        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": "Hello", "max_tokens": 2, "temperature": 0, "stream": True}) as r:
            events = sse_events(list(r.iter_lines()))
        [line] = _lines(caplog, events[0]["id"])
        assert "/v1/completions finished: stream=true" in line.getMessage()
        assert "completion_tokens=2 finish_reason=length" in line.getMessage()

        caplog.clear()
        bad = httpx.post(url + "/v1/chat/completions", json={**chat, "temperature": 3}, timeout=30)
        assert bad.status_code == 400
        [line] = _lines(caplog, "POST /v1/chat/completions 400")
        assert line.levelno == logging.INFO and line.exc_info is None
        assert line.getMessage().endswith(bad.json()["error"]["message"])

        long = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
            first = next(line for line in r.iter_lines() if line)  # generating; then the client leaves
        [line] = _lines(caplog, "aborted (client disconnected): stream=true")
        assert sse_events([first])[0]["id"] in line.getMessage() and "completion_tokens=" in line.getMessage()
        with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
            httpx.post(url + "/v1/completions", json=long, timeout=httpx.Timeout(30, read=0.5))
        [line] = _lines(caplog, "aborted (client disconnected): stream=false")
        assert "/v1/completions" in line.getMessage()
        assert not [r for r in caplog.records if r.name == "monobatch.server" and r.levelno > logging.INFO]


def test_the_log_line_reports_the_apis_finish_reason(loaded, caplog):
    """A chat reply of tool calls ends with the engine's ``stop`` and the API's ``tool_calls``:
    the request log says ``tool_calls``, as the response does, streamed and not."""
    import logging
    import re

    caplog.set_level(logging.INFO, logger="monobatch.server")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}}}]
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "temperature": 0,
            "max_tokens": 60, "tools": tools, "tool_choice": "required"}
    with ServerThread(create_app(ServerSettings(), lambda: new_scheduler(loaded, max_num_seqs=4))) as server:
        server.wait_ready(60)
        url = server.base_url + "/v1/chat/completions"
        done = httpx.post(url, json=body, timeout=60).json()
        assert done["choices"][0]["finish_reason"] == "tool_calls"
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            events = sse_events(list(r.iter_lines()))
        assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "tool_calls"
        for request_id in (done["id"], events[0]["id"]):
            [line] = _lines(caplog, request_id)
            assert dict(re.findall(r"(\w+)=(\S+)", line.getMessage()))["finish_reason"] == "tool_calls"


def test_seed_minus_1_is_a_random_seed_over_the_servers(loaded):
    """llama-server's ``seed: -1`` is "random": accepted on both endpoints (streamed too), and it
    overrides the server-wide ``--seed`` (here 42: requests without a seed repeat each other, those
    with -1 do not); other negative seeds stay a 400 naming ``seed``."""
    settings = ServerSettings(sampling_flags={"seed": 42, "temperature": 1.0})
    body = {"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True}
    with ServerThread(create_app(settings, lambda: new_scheduler(loaded, max_num_seqs=4))) as server:
        server.wait_ready(60)
        url = server.base_url

        def text(**kw):
            r = httpx.post(url + "/v1/completions", json={**body, **kw}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        seeded = {text(), text(), text(seed=42)}
        assert len(seeded) == 1  # the server's seed
        randoms = {text(seed=-1) for _ in range(3)}
        assert len(randoms) == 3 and not randoms & seeded
        two = httpx.post(url + "/v1/completions", json={**body, "seed": -1, "n": 2}, timeout=60).json()["choices"]
        assert len({c["text"] for c in two} | seeded) == 3  # each choice its own random seed
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "seed": -1}
        for stream in (False, True):
            r = httpx.post(url + "/v1/chat/completions", json={**chat, "stream": stream}, timeout=60)
            assert r.status_code == 200 and r.headers["content-type"].startswith(
                "text/event-stream" if stream else "application/json"), r.text
        bad = httpx.post(url + "/v1/completions", json={**body, "seed": -2}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "seed"
        assert "or -1 for a random seed" in bad.json()["error"]["message"]


def test_usage_is_counted_once_per_response(loaded, caplog, monkeypatch):
    """A response's usage is computed once and shared by what reports it: the final usage chunk of
    a stream (stream_options.include_usage) and the request's log line (generation.stream_frame),
    or the non-streamed body and its log line (generation.respond); both say the same numbers.
    ``usage`` is the real function, counted."""
    import logging
    import re

    import openai

    from monobatch.server import chat, completions, generation

    calls: list[int] = []
    real = generation.usage

    def counted(choices, n):
        calls.append(len(choices))
        return real(choices, n)

    for module in (generation, chat, completions):
        monkeypatch.setattr(module, "usage", counted)
    caplog.set_level(logging.INFO, logger="monobatch.server")
    with ServerThread(create_app(ServerSettings(), lambda: new_scheduler(loaded, max_num_seqs=4))) as server:
        server.wait_ready(60)
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        model = client.models.list().data[0].id
        msgs = [{"role": "user", "content": "Hi"}]
        for include_usage in (True, False):
            for endpoint in ("chat", "completions"):
                calls.clear()
                kw = {"stream": True, "max_tokens": 3, "temperature": 0, "n": 2, "model": model,
                      **({"stream_options": {"include_usage": True}} if include_usage else {})}
                chunks = list(client.chat.completions.create(messages=msgs, **kw) if endpoint == "chat"
                              else client.completions.create(prompt="Hello", **kw))
                [line] = _lines(caplog, chunks[0].id)
                fields = dict(re.findall(r"(\w+)=(\S+)", line.getMessage()))
                assert calls == [2], (endpoint, include_usage, calls)  # once per response, over its 2 choices
                if include_usage:
                    last = chunks[-1]
                    assert last.choices == [] and last.usage.completion_tokens == 6
                    assert int(fields["prompt_tokens"]) == last.usage.prompt_tokens
                    assert int(fields["completion_tokens"]) == last.usage.completion_tokens
                else:
                    assert all(c.usage is None for c in chunks) and fields["completion_tokens"] == "6"
        for endpoint in ("chat", "completions"):
            calls.clear()
            done = (client.chat.completions.create(messages=msgs, max_tokens=3, temperature=0, model=model)
                    if endpoint == "chat" else client.completions.create(prompt="Hello", max_tokens=3, temperature=0,
                                                                         model=model))
            [line] = _lines(caplog, done.id)
            fields = dict(re.findall(r"(\w+)=(\S+)", line.getMessage()))
            assert calls == [1], (endpoint, calls)
            assert int(fields["prompt_tokens"]) == done.usage.prompt_tokens
            assert int(fields["completion_tokens"]) == done.usage.completion_tokens == 3
