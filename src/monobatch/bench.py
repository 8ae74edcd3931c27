"""Engine-direct benchmarks: B=1 prefill and decode speed, and N concurrent requests against the
same N one after another, through the one decode loop.

Timed region: from a request's arrival in the scheduler to its last token — tokenization, HTTP
and model loading are outside. Each draw ends with a host sync (the token ids come back to the
host), so the wall-clock timings include every queued GPU kernel.
"""

from __future__ import annotations

import os
import random
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import psutil
import torch

from monobatch.engine.params import SamplingParams
from monobatch.engine.scheduler import BatchScheduler
from monobatch.engine.sequence import Request


@dataclass
class BenchResult:
    """One bench configuration's results (medians over ``runs``); times in ms, rates in tok/s."""

    model: str
    device: str
    dtype: str
    prompt_tokens: int
    gen_tokens: int
    runs: int
    load_s: float
    weight_mb: float
    peak_rss_mb: float
    ttft_ms: float
    prefill_tok_s: float
    decode_tok_s: float
    threads: int
    kv_storage: str = ""
    deterministic: bool = False
    engine: str = ""
    concurrency: dict | None = None
    samples: dict = field(default_factory=dict)

    def table(self) -> str:
        """A human-readable summary (stdout of ``monobatch bench``)."""
        return "\n".join([
            f"model {self.model}  device {self.device}  dtype {self.dtype}  threads {self.threads}",
            f"load {self.load_s:.2f} s  weights {self.weight_mb:.0f} MB  peak RSS {self.peak_rss_mb:.0f} MB",
            f"B=1  prompt {self.prompt_tokens} + gen {self.gen_tokens} tokens, median of {self.runs} runs:",
            f"  TTFT {self.ttft_ms:.1f} ms   prefill {self.prefill_tok_s:.1f} tok/s   decode {self.decode_tok_s:.1f} tok/s",
            f"  {self.engine}",
        ] + ([] if not self.concurrency else [
            f"{self.concurrency['requests']} requests: concurrent {self.concurrency['concurrent_tok_s']:.1f} tok/s "
            f"({self.concurrency['concurrent_s']:.2f} s), sequential {self.concurrency['sequential_tok_s']:.1f} tok/s "
            f"({self.concurrency['sequential_s']:.2f} s): {self.concurrency['speedup']:.2f}x",
        ]))

    def to_dict(self) -> dict:
        """The result as a JSON-ready dict (``monobatch bench --json``)."""
        return asdict(self)


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MB (getrusage; Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 if sys.platform != "darwin" else peak / 2**20


def run_once(scheduler: BatchScheduler, prompt_tokens: int, gen_tokens: int, rng: random.Random) -> tuple[float, float]:
    """One B=1 request of random prompt ids, greedy, ignore_eos. Returns (TTFT ms, decode tok/s)."""
    vocab = scheduler.engine.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    last = None
    for out in scheduler.run([Request(f"bench-{rng.random()}", prompt, params)]):
        last = out
    m = last.metrics
    return m.ttft_ms, m.decode_tok_per_s


def concurrent_vs_sequential(scheduler: BatchScheduler, requests: int, prompt_tokens: int, gen_tokens: int,
                             seed: int = 0) -> dict:
    """``requests`` random prompts (greedy, ignore_eos) submitted at once, then the same prompts
    one after another, in one process so the two are comparable as a ratio. Both passes bypass
    the prefix cache, so the second pass does not reuse the first one's KV.

    Returns:
        ``requests``, ``concurrent_s`` / ``sequential_s`` (wall seconds), generated tokens/s of
        each, ``speedup`` (sequential time / concurrent time).
    """
    rng = random.Random(seed)
    vocab = scheduler.engine.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(prompt_tokens)] for _ in range(requests)]
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for _ in scheduler.run([Request(f"c{i}", p, params, bypass_prefix_cache=True) for i, p in enumerate(prompts)]):
        pass
    concurrent = time.perf_counter() - start
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        for _ in scheduler.run([Request(f"s{i}", p, params, bypass_prefix_cache=True)]):
            pass
    sequential = time.perf_counter() - start
    total = requests * gen_tokens
    return {"requests": requests, "concurrent_s": round(concurrent, 3), "sequential_s": round(sequential, 3),
            "concurrent_tok_s": round(total / concurrent, 1), "sequential_tok_s": round(total / sequential, 1),
            "speedup": round(sequential / concurrent, 2)}


def bench(scheduler: BatchScheduler, prompt_tokens: int, gen_tokens: int, runs: int, seed: int = 0,
          concurrency: int = 0) -> BenchResult:
    """Warm up with one full-size request (allocator, kernels, KV growth), then time ``runs``
    B=1 requests; medians of TTFT and decode rate. With ``concurrency`` N > 0, also
    :func:`concurrent_vs_sequential` for N requests."""
    rng = random.Random(seed)
    loaded = scheduler.engine.loaded
    run_once(scheduler, prompt_tokens, gen_tokens, rng)
    ttfts, rates = [], []
    for _ in range(runs):
        ttft, rate = run_once(scheduler, prompt_tokens, gen_tokens, rng)
        ttfts.append(ttft)
        rates.append(rate)
    ttft = statistics.median(ttfts)
    return BenchResult(
        model=loaded.name, device=str(loaded.model.device), dtype=str(loaded.model.dtype).removeprefix("torch."),
        prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, runs=runs, load_s=round(loaded.load_seconds, 3),
        weight_mb=round(loaded.weight_bytes / 1e6, 1), peak_rss_mb=round(peak_rss_mb(), 1),
        ttft_ms=round(ttft, 2), prefill_tok_s=round(prompt_tokens / (ttft / 1000), 1),
        decode_tok_s=round(statistics.median(rates), 1), threads=torch.get_num_threads(),
        kv_storage=scheduler.config.kv_storage, deterministic=scheduler.config.deterministic,
        engine=scheduler.engine.describe(),
        concurrency=concurrent_vs_sequential(scheduler, concurrency, prompt_tokens, gen_tokens, seed) if concurrency else None,
        samples={"ttft_ms": [round(x, 2) for x in ttfts], "decode_tok_s": [round(x, 1) for x in rates],
                 "rss_now_mb": round(psutil.Process(os.getpid()).memory_info().rss / 1e6, 1)},
    )
