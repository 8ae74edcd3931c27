"""Engine-direct benchmarks: B=1 prefill and decode speed through the one decode loop.

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
    samples: dict = field(default_factory=dict)

    def table(self) -> str:
        """A human-readable summary (stdout of ``monobatch bench``)."""
        return "\n".join([
            f"model {self.model}  device {self.device}  dtype {self.dtype}  threads {self.threads}",
            f"load {self.load_s:.2f} s  weights {self.weight_mb:.0f} MB  peak RSS {self.peak_rss_mb:.0f} MB",
            f"B=1  prompt {self.prompt_tokens} + gen {self.gen_tokens} tokens, median of {self.runs} runs:",
            f"  TTFT {self.ttft_ms:.1f} ms   prefill {self.prefill_tok_s:.1f} tok/s   decode {self.decode_tok_s:.1f} tok/s",
        ])

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


def bench(scheduler: BatchScheduler, prompt_tokens: int, gen_tokens: int, runs: int, seed: int = 0) -> BenchResult:
    """Warm up with one full-size request (allocator, kernels, KV growth), then time ``runs``
    B=1 requests; medians of TTFT and decode rate."""
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
        samples={"ttft_ms": [round(x, 2) for x in ttfts], "decode_tok_s": [round(x, 1) for x in rates],
                 "rss_now_mb": round(psutil.Process(os.getpid()).memory_info().rss / 1e6, 1)},
    )
