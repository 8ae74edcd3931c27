"""`monobatch bench-serve` against a real `monobatch serve` process (the bundled model), plus its
pure parts (arrival times, percentiles)."""

from __future__ import annotations

import json
import math
import random
import socket

import pytest

from cli_util import assert_one_line_error, monobatch
from server_util import Server, shared_server
from test_server import MAIN_ARGS

LATENCIES = ("ttft", "tpot", "itl", "e2el")


@pytest.fixture(scope="module")
def server() -> Server:
    return shared_server("main", *MAIN_ARGS)  # the same server as test_server.py's


def bench_serve(server: Server, *args: str):
    res = monobatch("bench-serve", "--base-url", server.base_url, *args, timeout=120)
    assert "Traceback" not in res.stderr, res.stderr
    return res


def test_json_result(server):
    res = bench_serve(server, "--num-prompts", "6", "--input-len", "24", "--output-len", "6", "--request-rate", "30",
                      "--max-concurrency", "3", "--seed", "1", "--label", "t", "--json")
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.splitlines()) == 1  # one JSON line: usable as a bench_rounds arm
    out = json.loads(res.stdout)
    assert out["label"] == "t" and out["endpoint"] == "/v1/completions" and out["model"]
    assert (out["num_prompts"], out["input_len"], out["output_len"]) == (6, 24, 6)
    assert (out["request_rate"], out["max_concurrency"], out["seed"]) == (30, 3, 1)
    assert (out["completed"], out["failed"], out["first_error"]) == (6, 0, None)
    assert out["total_output_tokens"] == 6 * 6 and out["usage_from_server"] is True
    assert 6 * 24 * 0.7 <= out["total_input_tokens"] <= 6 * 24 * 1.3  # --input-len is approximate
    assert out["duration_s"] > 0
    assert out["client_cpu_s"] > 0  # the client's own CPU time: near duration_s, the client limits the run
    assert out["client_cpu_util"] == pytest.approx(out["client_cpu_s"] / out["duration_s"], abs=0.01)
    assert out["request_throughput"] == pytest.approx(6 / out["duration_s"], rel=1e-2)
    assert out["output_throughput"] == pytest.approx(36 / out["duration_s"], rel=1e-2)
    assert out["total_token_throughput"] == pytest.approx(
        (out["total_input_tokens"] + 36) / out["duration_s"], rel=1e-2)
    for name in LATENCIES:
        mean, median, p90, p99 = (out[f"{k}_{name}_ms"] for k in ("mean", "median", "p90", "p99"))
        assert 0 < median <= p90 <= p99, (name, out)
        assert 0 < mean <= p99 and out[f"std_{name}_ms"] >= 0
    assert out["mean_ttft_ms"] < out["mean_e2el_ms"]
    assert out["p99_e2el_ms"] <= out["duration_s"] * 1000
    # 6 requests x 5 gaps: the TPOT of each is its mean ITL
    assert out["mean_tpot_ms"] == pytest.approx(out["mean_itl_ms"], rel=0.25)
    assert len([ln for ln in res.stderr.splitlines() if ln.strip()]) == 1  # the start line


def test_concurrency_cap_and_chat_table(server):
    """--max-concurrency 1 runs the requests one after another (the duration is the sum of their
    latencies); the table has vLLM's rows."""
    res = bench_serve(server, "--num-prompts", "3", "--input-len", "8", "--output-len", "3", "--max-concurrency", "1",
                      "--endpoint", "chat", "--num-warmups", "1", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["endpoint"] == "/v1/chat/completions" and out["completed"] == 3 and out["total_output_tokens"] == 9
    assert out["duration_s"] * 1000 >= 0.95 * 3 * out["mean_e2el_ms"]
    res = bench_serve(server, "--num-prompts", "2", "--input-len", "8", "--output-len", "2")
    assert res.returncode == 0, res.stderr
    for row in ("Successful requests:", "Failed requests:", "Benchmark duration (s):", "Request throughput (req/s):",
                "Output token throughput (tok/s):", "Total token throughput (tok/s):", "Median TTFT (ms):",
                "P99 TPOT (ms):", "P90 ITL (ms):", "Mean E2EL (ms):"):
        assert row in res.stdout, res.stdout


def test_failed_requests_are_counted(server):
    """A 4xx is a failed request with its message, not a traceback; none succeeding is exit 1."""
    res = bench_serve(server, "--num-prompts", "3", "--input-len", "8", "--output-len", "2", "--model", "nope",
                      "--json")
    assert res.returncode == 1
    out = json.loads(res.stdout)
    assert (out["completed"], out["failed"]) == (0, 3)
    # the message of monobatch.cli.http_client (the one error formatter of the HTTP clients)
    assert out["first_error"].startswith("the server answered HTTP 404:") and "nope" in out["first_error"]
    assert out["median_ttft_ms"] is None and out["errors"] == [{"message": out["first_error"], "count": 3}]
    assert res.stderr.splitlines()[-1].startswith("monobatch bench-serve: error: all 3 requests failed")


def test_unreachable_server_is_one_line():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = monobatch("bench-serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "2", timeout=60)
    assert res.returncode == 1
    assert_one_line_error(res, "cannot connect", str(port))


def test_bad_flags_are_refused():
    res = monobatch("bench-serve", "--request-rate", "0", timeout=60)
    assert res.returncode == 2 and "--request-rate" in res.stderr and "Traceback" not in res.stderr
    res = monobatch("bench-serve", "--num-prompts", "0", "--base-url", "http://127.0.0.1:9", timeout=60)
    assert_one_line_error(res, "--num-prompts")


def test_arrivals_and_percentiles():
    from monobatch.bench_serve import arrival_times, percentile, synthesize_prompts

    assert arrival_times(4, math.inf, 1.0, random.Random(0)) == [0.0] * 4
    times = arrival_times(4000, 10.0, 1.0, random.Random(0))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.08)  # Poisson: exponential gaps of mean 1/rate
    cv = (sum((g - 0.1) ** 2 for g in gaps) / len(gaps)) ** 0.5 / 0.1
    assert cv == pytest.approx(1.0, rel=0.1)
    steady = arrival_times(4000, 10.0, 50.0, random.Random(0))  # burstiness > 1: steadier arrivals
    sgaps = [b - a for a, b in zip(steady, steady[1:])]
    assert max(sgaps) < max(gaps)
    assert percentile([1.0], 99) == 1.0
    assert percentile([1, 2, 3, 4, 5], 50) == 3 and percentile([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)
    assert percentile([10, 0], 99) == pytest.approx(9.9)
    a, b = synthesize_prompts(2, 50, 3, 1.0)
    assert a != b and len(a.split()) == 50 and synthesize_prompts(2, 50, 3, 1.0) == [a, b]
    assert len(synthesize_prompts(1, 50, 3, 1.25)[0].split()) == 40
    # the one synthesizer (monobatch.synth), as monobatch bench's prompts: sentences of its word list
    from monobatch.synth import synth_text

    rng = random.Random(3)
    assert [synth_text(rng, 50), synth_text(rng, 50)] == [a, b] and a[0].isupper() and "." in a


def test_stream_events_ok_error_and_cut_short():
    """send_request reads the stream with the HTTP clients' one SSE parser: text events timed,
    usage taken from the server, an error event / llama.cpp error line / missing [DONE] a failure."""
    import asyncio

    import httpx

    from monobatch.bench_serve import ServeBenchConfig, request_body, send_request

    text = 'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
    usage = 'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}\n\n'
    streams = {
        "ok": [": keep-alive\n\n", text, text, usage, "data: [DONE]\n\n"],
        "error-event": [text, 'data: {"error": {"message": "engine failed"}}\n\n'],
        "llama-error": [text, 'error: {"message": "slot failed"}\n\n'],
        "cut": [text],
        "http-500": None,
    }

    def handler(request: httpx.Request) -> httpx.Response:
        lines = streams[json.loads(request.content)["prompt"]]
        if lines is None:
            return httpx.Response(500, text="oops")
        return httpx.Response(200, content="".join(lines).encode(), headers={"content-type": "text/event-stream"})

    cfg = ServeBenchConfig(base_url="http://bench.test")

    async def send_all() -> dict:
        async with httpx.AsyncClient(base_url=cfg.root, transport=httpx.MockTransport(handler)) as http:
            return {name: await send_request(http, cfg, request_body(cfg, "m", name, 2)) for name in streams}

    got = asyncio.run(send_all())
    ok = got["ok"]
    assert ok.ok and (ok.output_tokens, ok.prompt_tokens, ok.usage_from_server) == (2, 5, True)
    assert 0 < ok.ttft <= ok.latency and len(ok.itl) == 1
    assert not any(got[k].ok for k in ("error-event", "llama-error", "cut", "http-500"))
    assert got["error-event"].error == "the server failed during the reply: engine failed"
    assert got["llama-error"].error == "the server failed during the reply: slot failed"
    assert got["cut"].error == "the server at http://bench.test closed the stream before the reply ended"
    assert got["http-500"].error == "the server answered HTTP 500: oops"


def test_silent_server_read_timeout_names_the_seconds():
    """A server that accepts connections but never answers (a listening socket nobody reads):
    the error says how long it waited, both before the run (the CLI) and per request."""
    import asyncio

    import httpx

    from monobatch.bench_serve import ServeBenchConfig, request_body, send_request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)  # the kernel completes connections; nothing ever answers
        base = f"http://127.0.0.1:{s.getsockname()[1]}"
        res = monobatch("bench-serve", "--base-url", base, "--timeout", "1.5", "--num-prompts", "1", timeout=60)
        assert res.returncode == 1
        assert_one_line_error(res, f"the server at {base} sent nothing for 1.5 s")

        cfg = ServeBenchConfig(base_url=base, timeout=0.5)

        async def one():
            async with httpx.AsyncClient(base_url=cfg.root, timeout=httpx.Timeout(cfg.timeout, connect=5)) as http:
                return await send_request(http, cfg, request_body(cfg, "m", "hi", 2))

        got = asyncio.run(one())
    assert not got.ok and got.error == f"the server at {base} sent nothing for 0.5 s"


def test_preflight_sizes_prompts_with_llama_servers_tokenize():
    """llama-server's /tokenize takes ``content`` and answers a token list without ``count``
    (and no tokens to the vLLM-shaped body): preflight counts that list, so its prompts are sized
    by the model's tokenizer as for monobatch and vLLM, not by the 1.3 tokens-a-word fallback."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from monobatch.bench_serve import FALLBACK_TOKENS_PER_WORD, ServeBenchConfig, preflight

    bodies: list[dict] = []

    class LlamaServerLike(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def answer(self, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.answer({"object": "list", "data": [{"id": "llama-1b-f16.gguf", "object": "model"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            words = len(body["content"].split()) if "content" in body else 0
            self.answer({"tokens": list(range(2 * words))})  # 2 tokens a word; [] without content

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), LlamaServerLike)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        cfg = ServeBenchConfig(base_url=f"http://127.0.0.1:{httpd.server_address[1]}/v1", timeout=10)
        model, tokens_per_word = preflight(cfg)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert model == "llama-1b-f16.gguf"
    assert tokens_per_word == 2.0 != FALLBACK_TOKENS_PER_WORD
    assert [sorted(b) for b in bodies] == [["add_special_tokens", "model", "prompt"], ["add_special", "content"]]
    assert bodies[1]["add_special"] is False
