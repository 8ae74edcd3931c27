"""Where a B=1 CPU decode step of a real model goes (issue 17): per step wall and thread-CPU time
(medians), the time inside the C++ extension (every call of ``quant_cpu.module()``'s functions
timed, by name: the packed GEMVs, the fused ops, the attention; ``kernel_ms``), the host work
(``host_ms`` = step wall - extension time: Python, torch dispatch, allocations; of which
``forward_host_ms`` inside the model's forward and ``outside_forward_ms`` the engine's step around
it: scheduling, the KV store's prepare/commit, sampling, the finish checks), and optionally
torch.profiler's operator table or cProfile's top host functions over the decode steps.

The extension's functions are wrapped before the model loads (callers that bind a function once,
:class:`monobatch.models.layers.CpuRoute`, bind the wrapper), so the same script times the unfused
and the fused layers alike; the wrapper's own cost (~1 us a call) lands in ``kernel_ms``. A decode
step through the whole-model layer chain (``DecoderModel.chained``) is one ``LayerChain.run``.

    PYTHONPATH=src .venv/bin/python scripts/profile_cpu_decode.py -t 1                 # the bundled model
    PYTHONPATH=src .venv/bin/python scripts/profile_cpu_decode.py -t 1 --kv-storage dense --torch-profile
    MONOBATCH_CPU_KERNELS=0 PYTHONPATH=src .venv/bin/python scripts/profile_cpu_decode.py --cprofile 30
        # (without the fused CPU ops)

Prompt: 128 token ids, then ``-n`` greedy decode steps (EOS ignored). The thread-CPU time is the
engine thread's own (at ``-t 1`` the whole step), the measure other processes on a shared machine
inflate least.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

from monobatch.engine.engine import Engine, EngineConfig
from monobatch.engine.params import SamplingParams
from monobatch.engine.scheduler import BatchScheduler
from monobatch.engine.sequence import Request
from monobatch.kernels import quant_cpu
from monobatch.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="a .gguf or HF folder (default: the bundled model)")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-n", type=int, default=64, help="decode steps")
    ap.add_argument("--kv-storage", default="paged", choices=["paged", "dense"])
    ap.add_argument("--weights", default="packed", choices=["packed", "dequant"])
    ap.add_argument("--deterministic", action="store_true", help="the batch-invariant mode (row tiles, TP pieces)")
    ap.add_argument("--torch-profile", action="store_true", help="print torch.profiler's top operators")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N", help="print cProfile's N top host functions")
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    timed = Timed(quant_cpu.module(), spent, calls)
    quant_cpu.module = lambda: timed  # every caller asks module() (or binds a function it returned)
    loaded = load_model(ns.model, "cpu", progress=False, weights=ns.weights)
    engine = Engine(loaded, EngineConfig(kv_storage=ns.kv_storage, deterministic=ns.deterministic))
    sched = BatchScheduler(engine)
    prompt = list(range(1, 129))
    fwd = [0.0, 0.0]  # the model's forward: start, total seconds

    def pre(*_):
        fwd[0] = time.perf_counter()

    def post(*_):
        fwd[1] += time.perf_counter() - fwd[0]

    engine.model.register_forward_pre_hook(pre)
    engine.model.register_forward_hook(post)
    params = SamplingParams(max_tokens=ns.n, temperature=0.0, ignore_eos=True)
    for _ in sched.run([Request("warm", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                                bypass_prefix_cache=True)]):
        pass
    sched.add_request(Request("r", prompt, params, bypass_prefix_cache=True))
    sched.step()  # the prompt
    spent.clear()
    calls.clear()
    fwd[1] = 0.0
    walls, cpus = [], []
    prof = cProfile.Profile() if ns.cprofile else None
    tprof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if ns.torch_profile else None
    if prof:
        prof.enable()
    if tprof:
        tprof.__enter__()
    while sched.has_unfinished():
        t, c = time.perf_counter(), time.thread_time()
        sched.step()
        walls.append((time.perf_counter() - t) * 1000)
        cpus.append((time.thread_time() - c) * 1000)
    if tprof:
        tprof.__exit__(None, None, None)
        print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(ns.cprofile)
    n = len(walls)
    kernel = sum(spent.values()) * 1000 / n
    print(json.dumps({"threads": ns.threads, "kv": ns.kv_storage, "weights": ns.weights, "steps": n,
                      "step_wall_ms": round(statistics.median(walls), 2),
                      "step_wall_ms_mean": round(statistics.mean(walls), 2),
                      "step_thread_cpu_ms": round(statistics.median(cpus), 2),
                      "kernel_ms": round(kernel, 2), "host_ms": round(statistics.mean(walls) - kernel, 2),
                      "forward_host_ms": round(fwd[1] * 1000 / n - kernel, 2),
                      "outside_forward_ms": round(statistics.mean(walls) - fwd[1] * 1000 / n, 2),
                      "extension_calls_per_step": round(sum(calls.values()) / n, 1),
                      "by_function_ms": {k: round(v * 1000 / n, 2) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])},
                      "profiled": bool(prof or tprof)}))


class Timed:
    """The extension module with each function wrapped: wall time and calls summed by name."""

    def __init__(self, mod, spent: dict[str, float], calls: dict[str, int], prefix: str = "") -> None:
        self._mod, self._spent, self._calls, self._prefix = mod, spent, calls, prefix

    def __getattr__(self, name: str):
        fn = getattr(self._mod, name)
        if isinstance(fn, type):  # a class; LayerChain's instances' methods timed as "LayerChain.<method>"
            return fn if name != "LayerChain" else lambda: Timed(fn(), self._spent, self._calls, f"{name}.")
        if not callable(fn):
            return fn
        spent, calls, name = self._spent, self._calls, self._prefix + name

        def timed(*args):
            t = time.perf_counter()
            out = fn(*args)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
            calls[name] = calls.get(name, 0) + 1
            return out

        setattr(self, name, timed)
        return timed


if __name__ == "__main__":
    main()
