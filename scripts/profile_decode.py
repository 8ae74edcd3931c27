"""Where a B=1 decode step's time goes: wall time per step, the GPU time of the forward (CUDA
events around the graph replay or eager forward) and the host time around it (schedule,
sampler, finish step, detokenizer), plus torch.profiler's top operators.

    PYTHONPATH=src python3 scripts/profile_decode.py --shape llama-1b --device cuda [--enforce-eager] [--deterministic]
    PYTHONPATH=src python3 scripts/profile_decode.py --shape llama-1b --no-profile --trace OUT/trace.json   # + one step's GPU timeline
    python3 scripts/profile_decode.py --timeline OUT/trace.json                                            # that timeline again

Prints one JSON object (times in ms per decode step, medians over the steps).
"""

from __future__ import annotations

import argparse
import ast
import cProfile
import hashlib
import importlib
import json
import pstats
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
    ap.add_argument("--quant", help="random packed weights of this GGUF type's layout (Q4_0, Q4_K, Q8_0, Q6_K)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--deterministic", action="store_true", help="the engine's --deterministic mode")
    ap.add_argument("--no-profile", action="store_true", help="skip the torch.profiler tables")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="print the N host functions with the most own time over the decode steps (cProfile; "
                         "the times in that run's JSON are inflated by it)")
    ap.add_argument("--trace", metavar="FILE",
                    help="write a Chrome trace of 8 steady decode steps to FILE and print one step's GPU timeline")
    ap.add_argument("--timeline", metavar="FILE",
                    help="only print one step's GPU timeline from a trace --trace wrote (.json or .json.gz), and exit")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="override a module constant before the engine starts (A/B runs), e.g. "
                         "monobatch.kernels.paged_decode.MAX_SPLITS=64 (VALUE: a Python literal)")
    ns = ap.parse_args()
    if ns.timeline:
        print_timeline(ns.timeline)
        return
    for item in ns.set:
        target, value = item.split("=", 1)
        module, name = target.rsplit(".", 1)
        setattr(importlib.import_module(module), name, ast.literal_eval(value))
    loaded = dummy_model(ns.shape, ns.device, quant=ns.quant)
    engine = Engine(loaded, EngineConfig(cuda_graphs=not ns.enforce_eager, deterministic=ns.deterministic))
    sched = BatchScheduler(engine)
    cuda = engine.device.type == "cuda"
    forward = engine.forward
    gpu_ms: list[float] = []

    def timed_forward(batch, *args, **kw):
        if not cuda:
            return forward(batch, *args, **kw)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = forward(batch, *args, **kw)
        end.record()
        timed_forward.events.append((start, end))
        return out

    timed_forward.events = []
    engine.forward = timed_forward
    marks: dict[str, list[float]] = {"step_in": [], "forward_out": [], "sample_out": [], "finish_out": []}

    def stamp(name, fn):
        def wrapped(*a, **k):
            if name == "step_in":
                marks[name].append(time.perf_counter())
            out = fn(*a, **k)
            if name != "step_in":
                marks[name].append(time.perf_counter())
            return out
        return wrapped

    engine.step = stamp("step_in", engine.step)
    engine.forward = stamp("forward_out", engine.forward)
    engine.sampler.sample = stamp("sample_out", engine.sampler.sample)
    engine.finisher.apply = stamp("finish_out", engine.finisher.apply)
    params = SamplingParams(max_tokens=ns.n, temperature=0.0, ignore_eos=True)
    prompt = list(range(1, ns.p + 1))
    warm_tokens = [t for out in sched.run([Request("warm", prompt, params, bypass_prefix_cache=True)])
                   for t in out.token_ids]
    timed_forward.events.clear()
    sched.add_request(Request("r", prompt, params, bypass_prefix_cache=True))
    sched.step()  # prefill
    timed_forward.events.clear()
    walls, starts, ends = [], [], []
    for v in marks.values():
        v.clear()
    host_profile = cProfile.Profile() if ns.cprofile else None
    if host_profile:
        host_profile.enable()
    while sched.has_unfinished():
        t = time.perf_counter()
        sched.step()
        starts.append(t)
        ends.append(time.perf_counter())
        walls.append((ends[-1] - t) * 1000)
    if host_profile:
        host_profile.disable()
        pstats.Stats(host_profile).sort_stats("tottime").print_stats(ns.cprofile)
    k = min(len(v) for v in marks.values())
    seg = {  # ms per step, medians: where the host's time goes
        "schedule_ms": [(marks["step_in"][i] - starts[i]) * 1000 for i in range(k)],
        "forward_launch_ms": [(marks["forward_out"][i] - marks["step_in"][i]) * 1000 for i in range(k)],
        "sample_incl_gpu_wait_ms": [(marks["sample_out"][i] - marks["forward_out"][i]) * 1000 for i in range(k)],
        "finish_ms": [(marks["finish_out"][i] - marks["sample_out"][i]) * 1000 for i in range(k)],
        "after_ms": [(ends[i] - marks["finish_out"][i]) * 1000 for i in range(k)],
    }
    if cuda:
        torch.cuda.synchronize()
        gpu_ms = [s.elapsed_time(e) for s, e in timed_forward.events]

    if not ns.no_profile:
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as prof:
            for _ in sched.run([Request("prof", prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                                        bypass_prefix_cache=True)]):
                pass
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        if cuda:
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70))
    if ns.trace and cuda:
        trace_steps(sched, prompt, ns.trace)
    print(json.dumps({
        "shape": ns.shape, "set": ns.set, "device": str(engine.device), "graphs": engine.graphs is not None, "prompt": ns.p,
        "steps": len(walls), "step_wall_ms_median": round(statistics.median(walls), 4),
        "forward_gpu_ms_median": round(statistics.median(gpu_ms), 4) if gpu_ms else None,
        "decode_tok_s": round(1000 / statistics.median(walls), 1), "describe": engine.describe(),
        # the warm-up request's greedy tokens (compare runs of one shape and seed: A/B arms must agree)
        "tokens_sha1": hashlib.sha1(json.dumps(warm_tokens).encode()).hexdigest()[:12],
        **{name: round(statistics.median(v), 4) for name, v in seg.items() if v},
    }))


def trace_steps(sched: BatchScheduler, prompt: list[int], path: str) -> None:
    """Profile 8 steady decode steps (after 24), write a Chrome trace to ``path`` and print one
    step's GPU timeline (:func:`print_timeline`)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    sched.add_request(Request("trace", prompt, params, bypass_prefix_cache=True))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=0, warmup=24, active=8, repeat=1)) as prof:
        while sched.has_unfinished():
            sched.step()
            prof.step()
    prof.export_chrome_trace(path)
    print_timeline(path)


def print_timeline(path: str) -> None:
    """One decode step's GPU work from a Chrome trace (plain or .gz): the ops between the
    last two device-to-host copies (each step copies its draws back once), each with its start
    relative to the step, duration and the idle gap before it, in µs. Runs of Triton kernels
    (names starting with ``_``) fold into one line. Host-side gaps are inflated by the profiler."""
    import gzip

    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    marks = [i for i, e in enumerate(gpu) if "DtoH" in e["name"]]
    if len(marks) < 3:
        print(f"timeline: {len(marks)} device-to-host copies in the trace, need 3")
        return
    a, b = marks[-3], marks[-2]
    t0, prev_end, rows = gpu[a + 1]["ts"], gpu[a]["ts"] + gpu[a]["dur"], []
    # per kernel name: launches, their summed durations (PDL launches a kernel before the one it
    # waits for ends, so these overlap) and the time each adds to the step: its end minus the
    # latest end before it (any idle gap before it included), summed
    per: dict[str, list[float]] = {}
    for e in gpu[a + 1:b + 1]:
        end = e["ts"] + e["dur"]
        gap, added, prev_end = e["ts"] - prev_end, max(0.0, end - prev_end), max(prev_end, end)
        kernel = per.setdefault(e["name"][:60], [0, 0.0, 0.0])
        kernel[0], kernel[1], kernel[2] = kernel[0] + 1, kernel[1] + e["dur"], kernel[2] + added
        if e["name"].startswith("_") and rows and rows[-1]["triton"]:
            r = rows[-1]
            r["n"] += 1
            r["busy"] += e["dur"]
            r["end"] = max(r["end"], end)
        else:
            rows.append({"name": e["name"][:70], "ts": e["ts"], "end": end, "gap": gap, "n": 1,
                         "busy": e["dur"], "triton": e["name"].startswith("_")})
    print(f"one decode step, GPU: {gpu[b]['ts'] + gpu[b]['dur'] - t0:.1f} µs from its first op to its copy back")
    for r in rows:
        name = f"{r['n']} Triton kernels (busy {r['busy']:.1f})" if r["n"] > 1 else r["name"]
        print(f"  +{r['ts'] - t0:8.1f}  dur {r['end'] - r['ts']:7.1f}  gap {r['gap']:6.1f}  {name}")
    print("  per kernel: launches, summed duration, time added to the step (µs)")
    for name, (n, dur, added) in sorted(per.items(), key=lambda kv: -kv[1][2]):
        print(f"  {n:5d} {dur:9.1f} {added:9.1f}  {name}")


if __name__ == "__main__":
    main()
