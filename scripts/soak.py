"""Soak `monobatch serve`: many requests of random lengths, a fifth of them abandoned by their
client, then check that nothing leaked.

    .venv/bin/python scripts/soak.py [--requests 300] [--concurrency 8] [--seed 0]   (make soak)

Starts a server on a free loopback port (or uses --base-url), sends the requests (random prompt
and output lengths, chat or completions, streamed or not; ~20 % disconnect mid-stream or time
out), sampling the server's RSS after each one. Afterwards /metrics must show no running or
waiting request and no referenced KV block, exactly one aborted sequence per disconnected client,
and the RSS over requests 100..N must show no upward trend (least-squares slope x 200 requests
under --rss-slack-mib). Prints one JSON summary — also when a check fails or the run breaks off
(``failures`` says why); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum old songs".split()


def make_job(rng: random.Random, i: int) -> dict:
    """Request ``i``: endpoint, streaming, prompt (3-300 words), max_tokens (1-48), sampling,
    and whether (and after how many chunks) its client walks away."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 300)))
    return {"i": i, "chat": rng.random() < 0.5, "stream": rng.random() < 0.7, "prompt": prompt,
            "max_tokens": rng.randint(1, 48), "disconnect": rng.random() < 0.2, "chunks": rng.randint(1, 4),
            "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randint(0, 2**31)}


async def run_job(client: httpx.AsyncClient, job: dict) -> str:
    """Send one request; returns its outcome: ok, disconnected (the client left before the
    end: one sequence the server must abort), or an error string."""
    if job["chat"]:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": job["prompt"]}]}
    else:
        path, body = "/v1/completions", {"prompt": job["prompt"]}
    body.update(max_tokens=job["max_tokens"], temperature=job["temperature"], seed=job["seed"])
    if job["disconnect"]:
        body.update(max_tokens=400, ignore_eos=True)  # long enough to be cut
    if job["stream"]:
        body["stream"] = True
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if job["disconnect"] and seen >= job["chunks"]:
                        return "disconnected"  # leaving the block closes the connection
                    if line == "data: [DONE]":
                        return "ok"
        return "stream ended without [DONE]"
    try:
        r = await client.post(path, json=body, timeout=httpx.Timeout(600, read=0.3 if job["disconnect"] else 600))
    except httpx.ReadTimeout:
        return "disconnected"
    return "ok" if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ``ys`` over ``xs``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


async def soak(base_url: str, pid: int | None, jobs: list[dict], concurrency: int) -> dict:
    """Run ``jobs``, ``concurrency`` at a time; returns wall time, requests/s, outcome counts and
    the server's RSS (MiB) after each request (``pid`` None: not sampled)."""
    proc = psutil.Process(pid) if pid else None
    rss: list[tuple[int, float]] = []
    outcomes: dict[str, int] = {}
    done = 0
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600,
                                 limits=httpx.Limits(max_connections=concurrency * 2)) as client:
        async def one(job: dict) -> None:
            nonlocal done
            async with gate:
                outcome = await run_job(client, job)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            done += 1
            if proc is not None:
                rss.append((done, proc.memory_info().rss / 2**20))

        start = time.perf_counter()
        await asyncio.gather(*(one(job) for job in jobs))
        wall = time.perf_counter() - start
    return {"wall_s": round(wall, 1), "requests_per_s": round(len(jobs) / wall, 2), "outcomes": outcomes, "rss": rss}


def check(metrics: dict, before: dict, result: dict, rss: list[tuple[int, float]], rss_slack_mib: float,
          summary: dict) -> list[str]:
    """Fill ``summary`` from the idle server's metrics and the run; returns the failed checks."""
    failures = [o for o in result["outcomes"] if o not in ("ok", "disconnected")]
    abort = 'monobatch_request_success_total{finished_reason="abort"}'
    summary.update(disconnected=result["outcomes"].get("disconnected", 0),
                   running=metrics["monobatch_num_requests_running"], waiting=metrics["monobatch_num_requests_waiting"],
                   kv_used_blocks=metrics["monobatch_kv_cache_used_blocks"],
                   aborted_sequences=metrics.get(abort, 0) - before.get(abort, 0))
    if rss:
        first = min(100, len(rss) // 3)  # requests 100..N (a third in, for short runs)
        tail = [(i, mb) for i, mb in rss if i >= first]
        growth = slope([i for i, _ in tail], [mb for _, mb in tail]) * 200 if len(tail) > 2 else 0.0
        summary.update(rss_mib_from=round(tail[0][1], 1), rss_mib_at_end=round(tail[-1][1], 1),
                       rss_growth_mib_per_200_requests=round(growth, 2))
        if growth > rss_slack_mib:
            failures.append(f"RSS grows {growth:.1f} MiB per 200 requests")
    if summary["running"] or summary["waiting"] or summary["kv_used_blocks"]:
        failures.append("something is still running or holds KV")
    if summary["aborted_sequences"] != summary["disconnected"]:
        failures.append(f"{summary['aborted_sequences']:g} sequences aborted for {summary['disconnected']} "
                        f"disconnected clients")
    return failures


def main() -> int:
    """Parse flags, start (or use) a server, soak it, check it; prints the JSON summary."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-url", help="soak a running server instead of starting one (no RSS check)")
    ap.add_argument("--rss-slack-mib", type=float, default=32.0,
                    help="largest RSS growth over 200 requests (fitted slope) still counted as flat")
    ap.add_argument("--server-args", default="-t 1 -c 1024 --max-num-seqs 16 --kv-cache-memory 192M",
                    help="flags for the server this script starts")
    a = ap.parse_args()
    from server_util import Server, start_server

    rng = random.Random(a.seed)
    jobs = [make_job(rng, i) for i in range(a.requests)]
    summary: dict = {"requests": a.requests}
    failures: list[str] = []
    server = None
    try:
        server = None if a.base_url else start_server(*a.server_args.split())
        target = server or Server(None, a.base_url)
        before = target.metrics()
        result = asyncio.run(soak(target.base_url, server.proc.pid if server else None, jobs, a.concurrency))
        rss = result.pop("rss")
        summary.update(result)
        try:
            metrics = target.wait_idle(timeout=60)
        except AssertionError as exc:  # the checks below say what is left
            failures.append(f"not idle 60 s after the last request ({exc})")
            metrics = target.metrics()
        failures += check(metrics, before, result, rss, a.rss_slack_mib, summary)
    except Exception as exc:  # noqa: BLE001 - reported in the summary
        failures.append(f"the soak broke off: {type(exc).__name__}: {exc}")
    finally:
        if server is not None:
            server.stop()
        summary["ok"] = not failures
        summary["failures"] = failures
        print(json.dumps(summary))
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
