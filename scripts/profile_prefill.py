"""Where a batched prefill's time goes: B prompts of P tokens submitted at once, one token each
(so the run is prefill only), on random weights of a named shape.

    PYTHONPATH=src python3 scripts/profile_prefill.py --shape llama-1b -B 128 -p 128 [--deterministic] [--no-profile]

Prints one JSON object: the run's wall time (submit -> every first token), the steps and their
tokens, each step's wall time (ms) split into host time before the forward, the forward's GPU time
(CUDA events) and the rest; then torch.profiler's top operators of a second run (CUDA time and
host time). Times are medians of ``--runs`` runs after one warm-up.
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
    ap.add_argument("-B", type=int, default=128, help="prompts")
    ap.add_argument("-p", type=int, default=128, help="prompt tokens")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--max-num-batched-tokens", type=int)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also print the N host functions with the most own time over one more run (cProfile)")
    ns = ap.parse_args()
    loaded = dummy_model(ns.shape, ns.device)
    engine = Engine(loaded, EngineConfig(max_num_seqs=max(ns.B, 1), deterministic=ns.deterministic,
                                         max_num_batched_tokens=ns.max_num_batched_tokens))
    sched = BatchScheduler(engine)
    cuda = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    forward = engine.forward
    events: list = []

    def timed_forward(batch, *a, **k):
        if not cuda:
            return forward(batch, *a, **k)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = forward(batch, *a, **k)
        e.record()
        events.append((s, e, batch.num_tokens, len(batch.chunks)))
        return out

    engine.forward = timed_forward
    counter = iter(range(1 << 30))

    def run() -> dict:
        prompts = [[(7 * i + 13 * j) % (loaded.args.vocab_size - 1) + 1 for j in range(ns.p)] for i in range(ns.B)]
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        events.clear()
        sync()
        t0 = time.perf_counter()
        steps = []
        for p in prompts:
            sched.add_request(Request(f"p{next(counter)}", p, params, bypass_prefix_cache=True))
        while sched.has_unfinished():
            s = time.perf_counter()
            sched.step()
            sync()
            steps.append((time.perf_counter() - s) * 1000)
        wall = time.perf_counter() - t0
        gpu = [(s.elapsed_time(e), t, c) for s, e, t, c in events]
        return {"wall_ms": wall * 1000, "prefill_tok_s": ns.B * ns.p / wall, "steps": len(steps),
                "step_ms": [round(x, 2) for x in steps], "forward_gpu_ms": [round(g, 2) for g, _, _ in gpu],
                "step_tokens": [t for _, t, _ in gpu], "step_chunks": [c for _, _, c in gpu]}

    run()  # warm-up (Triton compiles, allocator)
    runs = [run() for _ in range(ns.runs)]
    best = sorted(runs, key=lambda r: r["wall_ms"])[len(runs) // 2]
    report = {"shape": ns.shape, "B": ns.B, "p": ns.p, "deterministic": ns.deterministic,
              "engine": engine.describe(), "wall_ms_runs": [round(r["wall_ms"], 2) for r in runs],
              "prefill_tok_s_median": round(statistics.median(r["prefill_tok_s"] for r in runs), 1), **best}
    if not ns.no_profile and cuda:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
        table = prof.key_averages()
        report["top_cuda"] = [(e.key, round(e.device_time_total / 1000, 2), e.count)
                              for e in sorted(table, key=lambda e: -e.device_time_total)[:15]]
        report["top_cpu"] = [(e.key, round(e.self_cpu_time_total / 1000, 2), e.count)
                             for e in sorted(table, key=lambda e: -e.self_cpu_time_total)[:15]]
    if ns.cprofile:
        import cProfile
        import io
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        run()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(ns.cprofile)
        report["cprofile"] = text.getvalue().splitlines()[-ns.cprofile - 2:]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
