"""Where a TP=2 decode step's time goes on CPU (ADR 0007; information, not a speed claim): the
bundled model, 33 greedy tokens at -t 1, the driver's wall and CPU time per step and the time it
spends inside the collectives (its own send plus the wait for rank 1).
Usage: .venv/bin/python scripts/cpu_tp_collectives.py
"""
import time, torch
from monobatch.loader import load_model
from monobatch.llm import LLM
from monobatch.engine.params import SamplingParams
from monobatch.distributed import comm
def main():
    torch.set_num_threads(1)
    loaded = load_model(None, "cpu", "auto", progress=False)
    stats = {"n": 0, "s": 0.0}
    for name in ("all_reduce", "gather", "all_gather"):
        f = getattr(comm.TpGroup, name)
        def wrap(self, x, f=f):
            t = time.perf_counter(); r = f(self, x); stats["s"] += time.perf_counter() - t; stats["n"] += 1; return r
        setattr(comm.TpGroup, name, wrap)
    llm = LLM(loaded=loaded, tensor_parallel_size=2)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate(["warm up"], sp)
    sp = SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)
    stats.update(n=0, s=0.0)
    t = time.perf_counter(); c = time.process_time()
    llm.generate(["The capital of France is"], sp)
    wall = time.perf_counter() - t
    print(f"steps 33: wall {wall*1000/33:.1f} ms/step, driver CPU {(time.process_time()-c)*1000/33:.1f} ms/step, "
          f"collectives {stats['n']/33:.0f}/step taking {stats['s']*1000/33:.1f} ms/step")
    llm.scheduler.engine.close()
if __name__ == "__main__":
    main()
