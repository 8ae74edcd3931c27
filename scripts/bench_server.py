"""What the HTTP side costs the engine: the same batch of streaming requests engine-direct and
through `monobatch serve` (engine thread), plus the IPC a child-process engine would add.

    .venv/bin/python scripts/bench_server.py [--clients 32] [--tokens 64] [--threads 1] [--device cpu]

1. engine-direct: ``BatchScheduler.step`` in a loop over C requests (C x T tokens, EOS ignored).
2. server: the same C requests as C concurrent SSE clients (httpx, asyncio, this process) against
   a `monobatch serve` subprocess whose engine runs on a thread.
3. IPC: one step's C RowOutputs through a ``multiprocessing.Queue`` to another process and back
   (pickle + pipe), the per-step toll a child-process engine pays on top of 1.

Both sides report the mean inter-token latency measured the same way — the engine's per-request
token gaps (``RequestMetrics.itl_ms``), which the server's ITL histogram observes — so the
comparison is like with like; the direct run also reports its median step time.

Prints one JSON object; the numbers go into docs/adr/0003-server.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))


def prompts(n: int) -> list[str]:
    """``n`` distinct short story openings (no shared prefix beyond a few tokens)."""
    return [f"Story {i}: once upon a time, in a village by the {w}," for i, w in
            zip(range(n), ["sea", "river", "forest", "mountain"] * (n // 4 + 1))]


def engine_direct(n: int, tokens: int, threads: int, device: str) -> dict:
    """``n`` greedy requests of ``tokens`` tokens through ``BatchScheduler.step`` in this process:
    throughput, median step time, mean inter-token latency."""
    import torch

    from monobatch.engine.engine import Engine, EngineConfig
    from monobatch.engine.params import SamplingParams
    from monobatch.engine.scheduler import BatchScheduler
    from monobatch.engine.sequence import Request
    from monobatch.loader import load_model

    torch.set_num_threads(threads)
    loaded = load_model(None, device, None, progress=False)
    tok = loaded.tokenizer
    sched = BatchScheduler(Engine(loaded, EngineConfig(max_model_len=1024, max_num_seqs=n)))
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    list(sched.run([Request("warm", tok.encode("warm up"), SamplingParams(temperature=0, max_tokens=4))]))
    reqs = [Request(f"r{i}", tok.encode(p), params) for i, p in enumerate(prompts(n))]
    start = time.perf_counter()
    steps = []
    for r in reqs:
        sched.add_request(r)
    generated, gaps = 0, []
    while sched.has_unfinished():
        t = time.perf_counter()
        outputs = sched.step()
        steps.append(time.perf_counter() - t)
        generated += sum(len(o.token_ids) for o in outputs)
        gaps += [g for o in outputs if o.metrics is not None for g in o.metrics.itl_ms]
    wall = time.perf_counter() - start
    return {"wall_s": round(wall, 3), "tok_per_s": round(generated / wall, 1),
            "median_step_ms": round(statistics.median(steps) * 1000, 2),
            "mean_itl_ms": round(statistics.fmean(gaps), 2)}


async def _client(client: httpx.AsyncClient, prompt: str, tokens: int) -> int:
    """One streaming completions request; returns the number of SSE chunks."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    n = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                n += 1
    return n


def through_server(n: int, tokens: int, threads: int, device: str) -> dict:
    """The same requests as ``n`` concurrent SSE clients of a `monobatch serve` subprocess:
    throughput and mean inter-token latency (from its /metrics histogram, warm-up excluded)."""
    from server_util import start_server

    server = start_server("-t", str(threads), "-c", "1024", "--max-num-seqs", str(n), "--device", device)
    try:
        async def run() -> tuple[float, int, dict]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=600,
                                         limits=httpx.Limits(max_connections=n + 8)) as client:
                await _client(client, "warm up", 4)
                before = server.metrics()  # the warm-up request's gaps are not counted
                start = time.perf_counter()
                chunks = await asyncio.gather(*(_client(client, p, tokens) for p in prompts(n)))
                return time.perf_counter() - start, sum(chunks), before

        wall, chunks, before = asyncio.run(run())
        m = server.metrics()
        gaps = m["monobatch_inter_token_latency_seconds_count"] - before["monobatch_inter_token_latency_seconds_count"]
        itl = (m["monobatch_inter_token_latency_seconds_sum"]
               - before["monobatch_inter_token_latency_seconds_sum"]) / max(gaps, 1)
    finally:
        server.stop()
    return {"wall_s": round(wall, 3), "tok_per_s": round(n * tokens / wall, 1), "sse_chunks": chunks,
            "mean_itl_ms": round(itl * 1000, 2)}


def _echo(inbox, outbox) -> None:
    """The child process of :func:`ipc_round_trip`: send back whatever arrives, until None."""
    while (item := inbox.get()) is not None:
        outbox.put(item)


def ipc_round_trip(n: int, reps: int = 300) -> dict:
    """One-way time for one step's ``n`` RowOutputs through a multiprocessing.Queue (pickle +
    pipe), halved from ``reps`` round trips."""
    from monobatch.engine.finish import RowOutput

    outputs = [RowOutput(f"cmpl-{'0' * 32}-{i}", [1234], " word", num_prompt_tokens=20, num_output_tokens=5)
               for i in range(n)]
    inbox, outbox = mp.Queue(), mp.Queue()
    proc = mp.Process(target=_echo, args=(inbox, outbox), daemon=True)
    proc.start()
    inbox.put(outputs)
    outbox.get()
    start = time.perf_counter()
    for _ in range(reps):
        inbox.put(outputs)
        outbox.get()
    per_step = (time.perf_counter() - start) / reps / 2  # one direction
    inbox.put(None)
    proc.join()
    return {"one_way_per_step_us": round(per_step * 1e6, 1)}


def main() -> None:
    """Run the three measurements and print them as one JSON object."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = {"clients": a.clients, "tokens": a.tokens, "threads": a.threads, "cpus": os.cpu_count(),
              "device": a.device, "server": through_server(a.clients, a.tokens, a.threads, a.device),
              "engine_direct": engine_direct(a.clients, a.tokens, a.threads, a.device),
              "ipc": ipc_round_trip(a.clients)}
    result["server_vs_direct"] = round(result["server"]["tok_per_s"] / result["engine_direct"]["tok_per_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
