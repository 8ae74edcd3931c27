"""Scratch count (2026-12-04): per step of one constrained B=32 round (the bundled model, 48 tokens), how many
    rows forced_draws redraws and how many go through _argmax_among, with its widest row. Run from the
    repository root: PYTHONPATH=src .venv/bin/python docs/benchmarks/data/2026-12-04-cpu-constrained-host/count_forced.py"""
import sys, collections
sys.path.insert(0, "scripts")
import profile_constrained_host as pch, torch
from monobatch.bench import synth_prompt
from monobatch.engine import sampler as sm
from monobatch.loader import load_model
torch.set_num_threads(1)
ks, widths = [], []
real = sm.RowSampler._argmax_among
def among(logits, local, allowed, tags=()):
    ks.append(len(local)); widths.append(max(len(a) for a in allowed))
    return real(logits, local, allowed, tags)
sm.RowSampler._argmax_among = staticmethod(among)
fd = []
realfd = sm.RowSampler.forced_draws
def forced(self, *a, **k):
    r = realfd(self, *a, **k); fd.append(0 if r is None else len(r[0])); return r
sm.RowSampler.forced_draws = forced
loaded = load_model(None, device="cpu", dtype="float32", progress=False)
prompts = [synth_prompt(loaded.tokenizer, 64, seed=i) for i in range(32)]
pch.one_round(loaded, prompts, 48, True, 6)
print("among k", ks); print("width", widths); print("forced rows per step", fd)
