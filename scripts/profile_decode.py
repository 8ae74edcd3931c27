"""Where a B=1 decode step's time goes: wall time per step, the GPU time of the forward (CUDA
events around the graph replay or eager forward) and the host time around it (schedule,
sampler, finish step, detokenizer), plus torch.profiler's top operators.

    PYTHONPATH=src python3 scripts/profile_decode.py --shape llama-1b --device cuda [--enforce-eager]

Prints one JSON object (times in ms per decode step, medians over the steps).
"""

from __future__ import annotations

import argparse
import ast
import cProfile
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
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-profile", action="store_true", help="skip the torch.profiler tables")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="print the N host functions with the most own time over the decode steps (cProfile; "
                         "the times in that run's JSON are inflated by it)")
    ap.add_argument("--trace", metavar="FILE",
                    help="write a Chrome trace of 8 steady decode steps to FILE and print the GPU timeline of one step "
                         "(every GPU op outside the largest run of back-to-back kernels, with its gap before it)")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="override a module constant before the engine starts (A/B runs), e.g. "
                         "monobatch.kernels.paged_decode.MAX_SPLITS=64 (VALUE: a Python literal)")
    ns = ap.parse_args()
    for item in ns.set:
        target, value = item.split("=", 1)
        module, name = target.rsplit(".", 1)
        setattr(importlib.import_module(module), name, ast.literal_eval(value))
    loaded = dummy_model(ns.shape, ns.device)
    engine = Engine(loaded, EngineConfig(cuda_graphs=not ns.enforce_eager))
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
    for _ in sched.run([Request("warm", prompt, params, bypass_prefix_cache=True)]):
        pass
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
        **{name: round(statistics.median(v), 4) for name, v in seg.items() if v},
    }))


def trace_steps(sched: BatchScheduler, prompt: list[int], path: str) -> None:
    """Profile 8 steady decode steps (after 24) and print one step's GPU timeline: each GPU op
    (kernel, memcpy, memset) with its start relative to the step, duration and the idle gap before
    it, in µs; the graph's kernels are folded into one line per run of graph kernels."""
    from torch.profiler import ProfilerActivity, profile, schedule

    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    sched.add_request(Request("trace", prompt, params, bypass_prefix_cache=True))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=0, warmup=24, active=8, repeat=1)) as prof:
        while sched.has_unfinished():
            sched.step()
            prof.step()
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    graph_ids = {e["args"].get("graph id") for e in gpu if e["args"].get("graph id")}
    rows, prev_end, run = [], None, None
    for e in gpu:
        gap = 0.0 if prev_end is None else e["ts"] - prev_end
        in_graph = bool(e["args"].get("graph id"))
        if in_graph and run is not None and gap < 50:
            run["dur"] = e["ts"] + e["dur"] - run["ts"]
            run["n"] += 1
            run["busy"] += e["dur"]
        else:
            run = {"name": "<graph>" if in_graph else e["name"][:60], "ts": e["ts"], "dur": e["dur"], "gap": gap,
                   "n": 1, "busy": e["dur"]} if in_graph else None
            rows.append(run or {"name": e["name"][:60], "ts": e["ts"], "dur": e["dur"], "gap": gap, "n": 1, "busy": e["dur"]})
        prev_end = e["ts"] + e["dur"]
    graphs = [i for i, r in enumerate(rows) if r["name"] == "<graph>"]
    print(f"trace: {len(gpu)} GPU ops, graph ids {sorted(graph_ids)}, {len(graphs)} graph runs")
    if len(graphs) >= 3:
        a, b = graphs[-3], graphs[-2]
        t0 = rows[a]["ts"]
        print(f"one step, graph run to graph run: {rows[b]['ts'] - t0:.1f} µs")
        for r in rows[a:b + 1]:
            fold = f"  ({r['n']} kernels, busy {r['busy']:.1f})" if r["n"] > 1 else ""
            print(f"  +{r['ts'] - t0:8.1f}  dur {r['dur']:7.1f}  gap {r['gap']:6.1f}  {r['name']}{fold}")


if __name__ == "__main__":
    main()
