"""A serving benchmark against a running OpenAI-compatible server, shaped like ``vllm bench serve``.

``monobatch bench-serve --base-url http://127.0.0.1:8080`` sends ``--num-prompts`` streaming
requests of synthesized text (about ``--input-len`` prompt tokens each; ``--output-len`` generated
tokens with ``ignore_eos`` and ``max_tokens``), at ``--request-rate`` requests/s with Poisson
arrivals (exponential gaps; ``--burstiness`` B draws gamma gaps of shape B, as vLLM; ``inf`` sends
all at once), each waiting for a free slot when ``--max-concurrency`` caps how many are in flight,
and reports what vLLM reports::

    ============ Serving Benchmark Result ============
    Successful requests:                     100
    Benchmark duration (s):                  12.34
    Request throughput (req/s):              8.10
    Output token throughput (tok/s):         1037.3
    ... TTFT, TPOT, ITL, E2E latency: mean / median / P90 / P99 in ms

Definitions (vLLM's):

- **TTFT**: from sending a request to the first stream event that carries generated text.
- **TPOT**: per request, (latency - TTFT) / (output tokens - 1): the time per output token after
  the first; requests of one output token have none.
- **ITL**: the gaps between consecutive stream events that carry text (an event may carry more
  than one token, e.g. text held back by a stop string).
- **E2EL**: from sending a request to the end of its stream.
- **duration**: from the first arrival to the last request's end; the throughputs divide by it.
- Output tokens are the server's ``usage.completion_tokens`` (asked for with
  ``stream_options: {include_usage: true}``), never a count of events; only when a server sends no
  usage are events counted (the result says so: ``usage_from_server: false``).

Prompts: random English-like sentences (:mod:`monobatch.synth`, seeded by ``--seed``), so no two
prompts share a prefix the prefix cache could reuse. Their length in words comes from one
``POST /tokenize`` of a sample (the tokens one word costs on this model: vLLM's and monobatch's
body and ``count`` answer, else llama-server's ``content`` body and ``tokens`` list; 1.3 when the
server has no ``/tokenize``), so ``--input-len`` is approximate; ``total_input_tokens`` is the server's count (``usage``). With
``--endpoint chat`` the text is one user message, and the chat template adds its tokens.

A request that fails (cannot connect, an HTTP error status, an error event, a stream cut short) is
counted in ``failed``; the first error's message is shown. All latency statistics are over the
successful requests.

``--json`` prints the result as one JSON object on one line (settings and results, vLLM's key
names: ``request_throughput``, ``output_throughput``, ``total_token_throughput``,
``mean_ttft_ms``, ``median_ttft_ms``, ``p90_ttft_ms``, ``p99_ttft_ms``, ``std_ttft_ms``, the
same for ``tpot``, ``itl`` and ``e2el``; the duration is ``duration_s``; ``client_cpu_s`` and
``client_cpu_util`` are this process's CPU time during the timed part and its share of the
duration: near 1, the client may be what limits the throughput), so
``scripts/bench_rounds.py`` can take it as an arm.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import httpx

from monobatch.cli.http_client import (CONNECT_TIMEOUT, ChatClient, ClientError, aiter_sse, auth_headers, base_root,
                                       check_base_url, refusal, transport_errors)
from monobatch.errors import MonobatchError, require_api_key
from monobatch.synth import synth_text

#: Percentiles reported for every latency (besides mean and median).
PERCENTILES = (90, 99)
#: Tokens per word assumed when the server cannot tokenize a sample.
FALLBACK_TOKENS_PER_WORD = 1.3

class BenchServeError(MonobatchError):
    """The benchmark could not run (server unreachable, no model, bad settings): one line for the user."""


@dataclass
class ServeBenchConfig:
    """The settings of one serving benchmark (the CLI flags)."""

    base_url: str = "http://127.0.0.1:8080"
    api_key: str | None = None
    model: str | None = None
    endpoint: str = "completions"
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    num_warmups: int = 0
    timeout: float = 600.0
    label: str | None = None

    @property
    def root(self) -> str:
        """The base URL without a trailing ``/`` or ``/v1``."""
        return base_root(self.base_url)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def headers(self) -> dict[str, str]:
        return auth_headers(self.api_key)


@dataclass
class RequestResult:
    """One request's outcome; times in seconds."""

    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    usage_from_server: bool = False
    error: str = ""


# -- prompts and arrivals -----------------------------------------------------------------------------

def synthesize_prompts(n: int, input_len: int, seed: int, tokens_per_word: float) -> list[str]:
    """``n`` texts of synthesized English (:func:`monobatch.synth.synth_text`, seeded), each
    about ``input_len`` tokens long (``input_len / tokens_per_word`` words)."""
    rng = random.Random(seed)
    words = max(1, round(input_len / tokens_per_word))
    return [synth_text(rng, words) for _ in range(n)]


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Seconds from the start at which each of ``n`` requests arrives: the first at 0, then gamma
    gaps of shape ``burstiness`` and mean 1/``rate`` (burstiness 1 = Poisson arrivals, vLLM's
    default); all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


# -- statistics ---------------------------------------------------------------------------------------

def percentile(values: list[float], p: float) -> float:
    """The ``p``-th percentile with linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def latency_stats(name: str, seconds: list[float]) -> dict[str, float | None]:
    """``mean_NAME_ms``, ``median_NAME_ms``, ``p90_NAME_ms``, ``p99_NAME_ms``, ``std_NAME_ms``
    (None when there are no values)."""
    ms = [s * 1000 for s in seconds]
    out: dict[str, float | None] = {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else None,
        f"median_{name}_ms": statistics.median(ms) if ms else None,
    }
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = percentile(ms, p) if ms else None
    out[f"std_{name}_ms"] = statistics.pstdev(ms) if ms else None
    return {k: (round(v, 3) if v is not None else None) for k, v in out.items()}


def summarize(cfg: ServeBenchConfig, model: str, results: list[RequestResult], duration: float,
              tokens_per_word: float, client_cpu_s: float | None = None) -> dict[str, Any]:
    """The JSON result: settings, then counts, throughputs and latency statistics.

    ``client_cpu_s``: this process's CPU time during the timed requests (all threads). Near
    ``duration_s`` (``client_cpu_util`` near 1) the client, not the server, may be what limits the
    throughput: one Python process parses every stream event."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    errors: dict[str, int] = {}
    for r in failed:
        errors[r.error] = errors.get(r.error, 0) + 1
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    rate = cfg.request_rate
    out: dict[str, Any] = {
        "label": cfg.label if cfg.label is not None else "",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "backend": "openai-chat" if cfg.endpoint == "chat" else "openai",
        "base_url": cfg.root, "endpoint": cfg.path, "model": model,
        "num_prompts": cfg.num_prompts, "input_len": cfg.input_len, "output_len": cfg.output_len,
        "request_rate": "inf" if math.isinf(rate) else rate, "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency, "seed": cfg.seed, "num_warmups": cfg.num_warmups,
        "tokens_per_word": round(tokens_per_word, 3),
        "completed": len(ok), "failed": len(failed),
        "duration_s": round(duration, 4),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": round(len(ok) / duration, 4) if duration > 0 else None,
        "output_throughput": round(total_out / duration, 3) if duration > 0 else None,
        "total_token_throughput": round((total_in + total_out) / duration, 3) if duration > 0 else None,
        "usage_from_server": all(r.usage_from_server for r in ok) if ok else None,
        "client_cpu_s": round(client_cpu_s, 3) if client_cpu_s is not None else None,
        "client_cpu_util": round(client_cpu_s / duration, 3) if client_cpu_s is not None and duration > 0 else None,
    }
    out.update(latency_stats("ttft", [r.ttft for r in ok]))
    out.update(latency_stats("tpot", tpots))
    out.update(latency_stats("itl", [g for r in ok for g in r.itl]))
    out.update(latency_stats("e2el", [r.latency for r in ok]))
    out["first_error"] = failed[0].error if failed else None
    out["errors"] = [{"message": m, "count": c} for m, c in list(errors.items())[:5]]
    return out


def table(res: dict[str, Any]) -> str:
    """vLLM's "Serving Benchmark Result" block."""
    def num(v: Any, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    w = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="=")]

    def row(name: str, value: str) -> None:
        lines.append(f"{name:<40}{value}")

    row("Successful requests:", str(res["completed"]))
    row("Failed requests:", str(res["failed"]))
    if res["max_concurrency"] is not None:
        row("Maximum request concurrency:", str(res["max_concurrency"]))
    rate = res["request_rate"]
    row("Request rate configured (RPS):", "inf" if rate == "inf" else f"{rate:.2f}")
    row("Benchmark duration (s):", num(res["duration_s"]))
    row("Total input tokens:", str(res["total_input_tokens"]))
    row("Total generated tokens:", str(res["total_output_tokens"]))
    row("Request throughput (req/s):", num(res["request_throughput"]))
    row("Output token throughput (tok/s):", num(res["output_throughput"]))
    row("Total token throughput (tok/s):", num(res["total_token_throughput"]))
    for key, title, short in (("ttft", "Time to First Token", "TTFT"),
                              ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl", "Inter-token Latency", "ITL"),
                              ("e2el", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        row(f"Mean {short} (ms):", num(res[f"mean_{key}_ms"]))
        row(f"Median {short} (ms):", num(res[f"median_{key}_ms"]))
        for p in PERCENTILES:
            row(f"P{p} {short} (ms):", num(res[f"p{p}_{key}_ms"]))
    lines.append("=" * w)
    if res["usage_from_server"] is False:
        lines.append("note: the server sent no usage; output tokens were counted from stream events")
    if res["first_error"]:
        lines.append(f"first error ({res['failed']} failed): {res['first_error']}")
    return "\n".join(lines)


# -- HTTP ----------------------------------------------------------------------------------------------

def preflight(cfg: ServeBenchConfig) -> tuple[str, float]:
    """The model name (``--model`` or the first of ``GET /v1/models``) and the tokens one prompt
    word costs (one ``POST /tokenize`` of a sample; a fallback when the server has none).

    Raises:
        BenchServeError: unreachable, refused (401...), no model listed.
    """
    client = ChatClient(cfg.root, cfg.api_key, read_timeout=cfg.timeout, url_flag="--base-url")
    try:
        listed = client.model_id()  # asked even with --model: is the server there, does it take the key
        model = cfg.model or listed
        if not model:
            raise BenchServeError(f"{cfg.root}/v1/models lists no model; pass --model NAME")
        sample = synthesize_prompts(1, 400, cfg.seed + 7919, 1.0)[0]
        count = client.count_tokens(model, sample) or llama_server_token_count(cfg, sample)
    except ClientError as exc:
        raise BenchServeError(str(exc)) from None
    finally:
        client.close()
    return model, count / len(sample.split()) if count else FALLBACK_TOKENS_PER_WORD


def llama_server_token_count(cfg: ServeBenchConfig, text: str) -> int | None:
    """Tokens ``text`` makes on a llama-server, whose ``POST /tokenize`` takes llama.cpp's body
    (``content``, ``add_special``) and answers ``{"tokens": [...]}`` without a ``count`` (to the
    vLLM-shaped body :meth:`ChatClient.count_tokens` sends, it answers no tokens). None when the
    server cannot tell. Without it prompts for llama-server would be sized by the fallback
    tokens-per-word, not by the model's tokenizer, and differ from those another server gets."""
    try:
        r = httpx.post(f"{cfg.root}/tokenize", json={"content": text, "add_special": False},
                       headers=cfg.headers(), timeout=httpx.Timeout(cfg.timeout, connect=CONNECT_TIMEOUT))
        tokens = r.json().get("tokens") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return len(tokens) if isinstance(tokens, list) and tokens else None


def request_body(cfg: ServeBenchConfig, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """The streaming request for one prompt: greedy, ``ignore_eos``, usage in the stream."""
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                            "temperature": 0.0, "ignore_eos": True}
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = max_tokens
    else:
        body["prompt"] = prompt
        body["max_tokens"] = max_tokens
    return body


def _carries_text(choice: dict[str, Any], chat: bool) -> bool:
    if chat:
        delta = choice.get("delta") or {}
        return isinstance(delta, dict) and bool(delta.get("content") or delta.get("reasoning_content"))
    return bool(choice.get("text"))


async def send_request(http: httpx.AsyncClient, cfg: ServeBenchConfig, body: dict[str, Any]) -> RequestResult:
    """Send one streaming request and time its events. Never raises (but for cancellation)."""
    res = RequestResult()
    chat = cfg.endpoint == "chat"
    events = 0
    start = time.perf_counter()
    last = start
    try:
        with transport_errors(cfg.root, cfg.timeout, "--base-url"):
            async with http.stream("POST", cfg.path, json=body) as r:
                if r.status_code >= 400:
                    await r.aread()
                    raise refusal(r, cfg.root, bool(cfg.api_key))
                async for payload in aiter_sse(r, cfg.root):
                    now = time.perf_counter()
                    usage = payload.get("usage")
                    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                        res.output_tokens = usage["completion_tokens"]
                        res.prompt_tokens = usage.get("prompt_tokens") or 0
                        res.usage_from_server = True
                    choices = payload.get("choices") or []
                    if any(isinstance(c, dict) and _carries_text(c, chat) for c in choices):
                        if events == 0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        events += 1
        end = time.perf_counter()
    except ClientError as exc:
        res.error = str(exc)
        return res
    if events == 0 and body.get("max_tokens", body.get("max_completion_tokens")):
        res.error = "the stream carried no generated text"
        return res
    if not res.usage_from_server:
        res.output_tokens = events
    res.latency = end - start
    res.ok = True
    return res


async def _run(cfg: ServeBenchConfig, model: str, prompts: list[str],
               warmups: list[str]) -> tuple[list[RequestResult], float, float]:
    """The warm-ups one at a time, then the timed requests at their arrival times; (results,
    duration, this process's CPU seconds during the timed part)."""
    slots = cfg.max_concurrency or cfg.num_prompts
    limits = httpx.Limits(max_connections=slots + 1, max_keepalive_connections=slots + 1)
    timeout = httpx.Timeout(cfg.timeout, connect=CONNECT_TIMEOUT, pool=None)
    async with httpx.AsyncClient(base_url=cfg.root, headers=cfg.headers(), timeout=timeout, limits=limits) as http:
        for w in warmups:
            res = await send_request(http, cfg, request_body(cfg, model, w, cfg.output_len))
            if not res.ok:
                raise BenchServeError(f"the warm-up request failed: {res.error}")
        semaphore = asyncio.Semaphore(slots)

        async def limited(body: dict[str, Any]) -> RequestResult:
            async with semaphore:
                return await send_request(http, cfg, body)

        arrivals = arrival_times(len(prompts), cfg.request_rate, cfg.burstiness, random.Random(cfg.seed + 1))
        bodies = [request_body(cfg, model, p, cfg.output_len) for p in prompts]
        tasks = []
        cpu_start = time.process_time()
        start = time.perf_counter()
        for at, body in zip(arrivals, bodies):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(body)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
    return list(results), duration, cpu


def validate(cfg: ServeBenchConfig) -> None:
    """Refuse settings that cannot run. Raises BenchServeError (InvalidRequestError: an API key
    that is empty or not printable ASCII without spaces, a base URL no request could use)."""
    if cfg.num_prompts < 1:
        raise BenchServeError("--num-prompts must be >= 1")
    if cfg.input_len < 1:
        raise BenchServeError("--input-len must be >= 1")
    if cfg.output_len < 1:
        raise BenchServeError("--output-len must be >= 1")
    if not cfg.request_rate > 0:
        raise BenchServeError("--request-rate must be > 0 (inf = all at once)")
    if not (cfg.burstiness > 0 and math.isfinite(cfg.burstiness)):
        raise BenchServeError("--burstiness must be > 0")
    if cfg.max_concurrency is not None and cfg.max_concurrency < 1:
        raise BenchServeError("--max-concurrency must be >= 1")
    if cfg.num_warmups < 0:
        raise BenchServeError("--num-warmups must be >= 0")
    if not cfg.timeout > 0:
        raise BenchServeError("--timeout must be > 0")
    if cfg.endpoint not in ("completions", "chat"):
        raise BenchServeError("--endpoint must be completions or chat")
    require_api_key(cfg.api_key)  # what serve takes; anything else an HTTP header cannot carry
    check_base_url(cfg.base_url, "--base-url")


def bench_serve(cfg: ServeBenchConfig, log=None) -> dict[str, Any]:
    """Run the benchmark and return the result dict (see :func:`summarize`).

    Args:
        log: where to print one start line (a file; None = stderr).

    Raises:
        BenchServeError: bad settings, the server unreachable or refusing before the run, a
            failed warm-up request.
    """
    validate(cfg)
    model, tokens_per_word = preflight(cfg)
    prompts = synthesize_prompts(cfg.num_prompts, cfg.input_len, cfg.seed, tokens_per_word)
    warmups = synthesize_prompts(cfg.num_warmups, cfg.input_len, cfg.seed + 104729, tokens_per_word)
    rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}/s"
    print(f"bench-serve: {cfg.num_prompts} requests to {model} at {cfg.root}{cfg.path} (~{cfg.input_len} + "
          f"{cfg.output_len} tokens, rate {rate}, max concurrency {cfg.max_concurrency or 'none'})",
          file=log or sys.stderr, flush=True)
    results, duration, cpu = asyncio.run(_run(cfg, model, prompts, warmups))
    return summarize(cfg, model, results, duration, tokens_per_word, cpu)
