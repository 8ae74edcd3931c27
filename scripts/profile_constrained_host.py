"""Host time per decode step of B greedy rows under ``bench --constrained``'s JSON schema against B
plain greedy rows, on the async-scheduling path (the one the GPU takes), on CPU.

A step's host time is the wall time of ``BatchScheduler.step`` minus the time inside
``Engine.forward`` (the model; on CPU it runs synchronously). What is left is the scheduler, the
sampler's launches (argmax and copies, which on CPU also compute), the finish step and, in the
constrained arm, the grammar work: the check of each raw draw, the redraw of a refused one under
its mask, the matchers' advance. Arms are interleaved (plain, constrained, ...) ``--rounds``
times; each prints its median and quartiles per step and per row. ``--profile ARM`` adds a cProfile
of one round of that arm (the functions by own time).

    PYTHONPATH=src python3 scripts/profile_constrained_host.py [-b 32] [-n 48] [--rounds 3] [--profile]

``--diff`` profiles one round of each arm and prints the functions by the own time the constrained
arm adds per row and step (cProfile's overhead included: compare rows, not totals). With ``--device
cuda`` the forward is asynchronous: a step's "host time" then holds any wait for the device (the
one read of the previous step's tokens, and every sync the grammar work adds), which is what a
host-bound step on the GPU spends.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import time

import torch

from monobatch.bench import bench_constraint, synth_prompt
from monobatch.engine.engine import Engine, EngineConfig
from monobatch.engine.params import SamplingParams
from monobatch.engine.scheduler import BatchScheduler
from monobatch.engine.sequence import Request
from monobatch.loader import load_model


def profile_diff(loaded, prompts, n: int, warm: int, top: int = 30) -> None:
    """One profiled round of each arm; print the own time the constrained arm adds, per row-step."""
    res = {}
    for constrained in (False, True):
        prof = cProfile.Profile()
        steps = len(one_round(loaded, prompts, n, constrained, warm, prof))
        stats = pstats.Stats(prof).stats
        res[constrained] = ({f"{k[0].rsplit('/', 1)[-1]}:{k[1]}({k[2]})": (v[2], v[0]) for k, v in stats.items()},
                            steps * len(prompts))
    (cons, rows), (plain, _) = res[True], res[False]
    diff = sorted((((cons.get(k, (0, 0))[0] - plain.get(k, (0, 0))[0]) / rows * 1e6, k) for k in set(cons) | set(plain)),
                  reverse=True)
    print(f"own time the constrained arm adds: {sum(d for d, _ in diff):.2f} us per row-step ({rows} row-steps)")
    for d, k in diff[:top]:
        print(f"{d:8.2f} us  {k}  calls {plain.get(k, (0, 0))[1]} -> {cons.get(k, (0, 0))[1]}")


def runtime_calls(loaded, prompts, n: int, warm: int, top: int = 25) -> None:
    """One round of each arm under ``torch.profiler`` (CPU activity, which records the CUDA
    runtime's calls: launches, copies, synchronizations, page-locked allocations), from the first
    timed decode step to the round's end: print the calls and ops by host time, per step, each arm."""
    from torch.profiler import ProfilerActivity, profile

    class FromFirstDecodeStep:  # one_round's profile hooks: the trace starts at the first timed step
        def __init__(self) -> None:
            self.prof, self.on = profile(activities=[ProfilerActivity.CPU]), False

        def enable(self) -> None:
            if not self.on:
                self.on = True
                self.prof.start()

        def disable(self) -> None:
            pass

    for constrained in (False, True):
        hooks = FromFirstDecodeStep()
        steps = len(one_round(loaded, prompts, n, constrained, warm, hooks))
        hooks.prof.stop()
        prof = hooks.prof
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
        print(f"{'constrained' if constrained else 'plain'}: {steps} timed steps; own host time per step, calls per step")
        for e in rows:
            print(f"  {e.self_cpu_time_total / steps:9.1f} us  {e.count / steps:6.2f}  {e.key}")


def one_round(loaded, prompts, n: int, constrained: bool, warm: int, profile: cProfile.Profile | None = None):
    """Host seconds of each decode step (after ``warm`` steps) that delivered tokens."""
    gc.collect()  # the last round's engine (its CUDA graphs hold cycles): its KV pool is freed first
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engine = Engine(loaded, EngineConfig(async_scheduling=True, max_num_seqs=len(prompts)))
    sched = BatchScheduler(engine)
    structured = bench_constraint() if constrained else None
    for i, p in enumerate(prompts):
        sched.add_request(Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                                               structured=structured), bypass_prefix_cache=True))
    inside, profiling = [0.0], [False]
    real_forward = engine.forward

    def forward(*args, **kw):  # timed, and left out of the profile
        if profile is not None:
            profile.disable()
        t0 = time.perf_counter()
        try:
            return real_forward(*args, **kw)
        finally:
            inside[0] += time.perf_counter() - t0
            if profile is not None and profiling[0]:
                profile.enable()

    engine.forward = forward
    host, steps = [], 0
    while sched.has_unfinished():
        inside[0] = 0.0
        decoding = steps >= warm and sched._pending is not None and not sched.waiting
        profiling[0] = decoding and profile is not None
        if profiling[0]:
            profile.enable()
        t0 = time.perf_counter()
        outs = sched.step()
        t1 = time.perf_counter()
        if profiling[0]:
            profile.disable()
        if decoding and outs:
            host.append(t1 - t0 - inside[0])
        steps += 1
    return host


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-b", "--batch", type=int, default=32)
    ap.add_argument("-n", type=int, default=48, help="tokens per request")
    ap.add_argument("-p", type=int, default=64, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm", type=int, default=6, help="steps skipped at the start (admission, prefill)")
    ap.add_argument("--profile", choices=("plain", "constrained"), help="cProfile one round of this arm")
    ap.add_argument("--diff", action="store_true", help="profile one round of each arm; print what the grammar adds")
    ap.add_argument("--runtime", action="store_true", help="torch.profiler of one round of each arm: "
                    "ops and CUDA runtime calls (copies, synchronizations) by host time per step")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-m", "--model", default=None, help="a GGUF (default: the bundled model)")
    ap.add_argument("--device", default="cpu")
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    loaded = load_model(ns.model, device=ns.device, dtype="float32" if ns.device == "cpu" else None, progress=False)
    prompts = [synth_prompt(loaded.tokenizer, ns.p, seed=i) for i in range(ns.batch)]
    one_round(loaded, prompts[:2], 8, True, 0)  # the grammar's tokenizer and first compile
    per = {False: [], True: []}
    for r in range(ns.rounds):
        for constrained in (False, True):
            host = one_round(loaded, prompts, ns.n, constrained, ns.warm)
            per[constrained].append(statistics.median(host))
            q = statistics.quantiles(host, n=4)
            print(f"round {r} {'constrained' if constrained else 'plain      '}: {len(host)} steps, host per step "
                  f"median {statistics.median(host) * 1e6:.0f} us (quartiles {q[0] * 1e6:.0f}-{q[2] * 1e6:.0f}), "
                  f"per row {statistics.median(host) / ns.batch * 1e6:.1f} us", flush=True)
    if ns.rounds:
        plain, cons = statistics.median(per[False]), statistics.median(per[True])
        print(f"B={ns.batch}: median of round medians: plain {plain * 1e6:.0f} us/step, constrained {cons * 1e6:.0f} "
              f"us/step; constraint work {(cons - plain) / ns.batch * 1e6:.1f} us per row per step")
    if ns.diff:
        profile_diff(loaded, prompts, ns.n, ns.warm)
    if ns.runtime:
        runtime_calls(loaded, prompts, ns.n, ns.warm)
    if ns.profile:
        prof = cProfile.Profile()
        one_round(loaded, prompts, ns.n, ns.profile == "constrained", ns.warm, prof)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue())


if __name__ == "__main__":
    main()
