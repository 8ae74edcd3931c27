"""Where a B=1 CPU decode step of a real model goes (issue 17): per step wall and thread-CPU time
(medians), the packed GEMVs' share (each ``quant_cpu.gemm`` call timed), and optionally
torch.profiler's operator table or cProfile's top host functions over the decode steps.

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
    ap.add_argument("--torch-profile", action="store_true", help="print torch.profiler's top operators")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N", help="print cProfile's N top host functions")
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    loaded = load_model(ns.model, "cpu", progress=False, weights=ns.weights)
    engine = Engine(loaded, EngineConfig(kv_storage=ns.kv_storage))
    sched = BatchScheduler(engine)
    prompt = list(range(1, 129))
    gemm_s, gemm = [0.0], quant_cpu.gemm

    def timed_gemm(*args):
        t = time.perf_counter()
        out = gemm(*args)
        gemm_s[0] += time.perf_counter() - t
        return out

    quant_cpu.gemm = timed_gemm
    params = SamplingParams(max_tokens=ns.n, temperature=0.0, ignore_eos=True)
    for _ in sched.run([Request("warm", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                                bypass_prefix_cache=True)]):
        pass
    sched.add_request(Request("r", prompt, params, bypass_prefix_cache=True))
    sched.step()  # the prompt
    gemm_s[0] = 0.0
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
    print(json.dumps({"threads": ns.threads, "kv": ns.kv_storage, "weights": ns.weights, "steps": len(walls),
                      "step_wall_ms": round(statistics.median(walls), 2),
                      "step_thread_cpu_ms": round(statistics.median(cpus), 2),
                      "gemv_wall_ms_per_step": round(gemm_s[0] * 1000 / len(walls), 2),
                      "profiled": bool(prof or tprof)}))


if __name__ == "__main__":
    main()
