"""Where a B=1 decode step's time goes: wall time per step, the GPU time of the forward (CUDA
events around the graph replay or eager forward) and the host time around it (schedule,
sampler, finish step, detokenizer), plus torch.profiler's top operators.

    PYTHONPATH=src python3 scripts/profile_decode.py --shape llama-1b --device cuda [--enforce-eager]

Prints one JSON object (times in ms per decode step, medians over the steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from monobatch.engine.engine import Engine, EngineConfig
from monobatch.engine.params import SamplingParams
from monobatch.engine.scheduler import BatchScheduler
from monobatch.engine.sequence import Request
from monobatch.loader.dummy import dummy_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("-p", type=int, default=256, help="prompt tokens")
    ap.add_argument("-n", type=int, default=128, help="decode steps")
    ap.add_argument("--enforce-eager", action="store_true")
    ns = ap.parse_args()
    loaded = dummy_model(ns.shape, ns.device)
    engine = Engine(loaded, EngineConfig(cuda_graphs=not ns.enforce_eager))
    sched = BatchScheduler(engine)
    cuda = engine.device.type == "cuda"
    forward = engine.forward
    gpu_ms: list[float] = []

    def timed_forward(batch):
        if not cuda:
            return forward(batch)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = forward(batch)
        end.record()
        timed_forward.events.append((start, end))
        return out

    timed_forward.events = []
    engine.forward = timed_forward
    params = SamplingParams(max_tokens=ns.n, temperature=0.0, ignore_eos=True)
    prompt = list(range(1, ns.p + 1))
    for _ in sched.run([Request("warm", prompt, params, bypass_prefix_cache=True)]):
        pass
    timed_forward.events.clear()
    sched.add_request(Request("r", prompt, params, bypass_prefix_cache=True))
    sched.step()  # prefill
    timed_forward.events.clear()
    walls = []
    while sched.has_unfinished():
        t = time.perf_counter()
        sched.step()
        walls.append((time.perf_counter() - t) * 1000)
    if cuda:
        torch.cuda.synchronize()
        gpu_ms = [s.elapsed_time(e) for s, e in timed_forward.events]
    top = ""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in sched.run([Request("prof", prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                                    bypass_prefix_cache=True)]):
            pass
    top = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    print(top)
    print(json.dumps({
        "shape": ns.shape, "device": str(engine.device), "graphs": engine.graphs is not None, "prompt": ns.p,
        "steps": len(walls), "step_wall_ms_median": round(statistics.median(walls), 4),
        "forward_gpu_ms_median": round(statistics.median(gpu_ms), 4) if gpu_ms else None,
        "decode_tok_s": round(1000 / statistics.median(walls), 1), "describe": engine.describe(),
    }))


if __name__ == "__main__":
    main()
