"""The deterministic mode's cost of the fixed piece order at TP=1 (ADR 0007): the bundled model's
greedy decode (48 tokens, -t 1) with the pieces (the engine as it is) and without them (the plan
switched off in-process, the pre-issue-19 deterministic mode), three rounds interleaved; CPU ms per
token (process time) and wall ms per token.   Usage: .venv/bin/python scripts/cpu_tp_pieces_cost.py
"""
import time, sys, torch
from monobatch.loader import load_model
from monobatch.llm import LLM
from monobatch.engine.params import SamplingParams
import monobatch.engine.engine as E
def run(llm, sp, prompt):
    c0, w0 = time.process_time(), time.perf_counter()
    out = llm.generate([prompt], sp)[0].outputs[0].token_ids
    return out, time.process_time() - c0, time.perf_counter() - w0
def main():
    torch.set_num_threads(1)
    loaded = load_model(None, "cpu", "auto", progress=False)
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    p = "The capital of France is"
    pieces = LLM(loaded=loaded, deterministic=True)
    orig = E.TensorParallelPlan.build
    E.TensorParallelPlan.build = staticmethod(lambda *a: None)
    plain = LLM(loaded=loaded, deterministic=True)
    E.TensorParallelPlan.build = orig
    for rnd in range(3):
        for name, llm in (("pieces", pieces), ("plain", plain)):
            out, cpu, wall = run(llm, sp, p)
            print(rnd, name, f"cpu {cpu*1000/48:.1f} ms/token wall {wall*1000/48:.1f}", out[:6], flush=True)
if __name__ == "__main__":
    main()
