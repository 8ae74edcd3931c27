"""Host time per row and decode step of the pieces the constrained arm runs, each timed on its own
(exclusive: a phase's time leaves out the phases it calls), on the bundled model, B greedy rows
with and without ``bench --constrained``'s JSON schema, async scheduling, CPU, one thread.

Why not scripts/profile_constrained_host.py's step medians: on this CPU a plain step's host time
is ~3 ms of tensor work (argmax over 32 x 49,152 logits and copies: device work on the GPU), and a
refusal's redraw (topk, ~0.7 ms, about half the steps) makes the constrained arm's step time
bimodal, so a few us a row of grammar host work is below its noise. Here the tensor-heavy pieces
are phases of their own (``sample``: ``RowSampler.draw``, ``redraw``: ``RowSampler.redraw``,
``forward``: ``Engine.forward``) and the rest is mostly Python:

* ``launch_ahead``: ``BatchScheduler._launch_ahead`` without ``Engine.launch`` (row checks, KV
  reservations, ``build_batch``);
* ``launch``: ``Engine.launch`` without the forward and ``_draw_async``;
* ``draw_async``: ``Engine._draw_async`` without ``RowSampler.draw`` (the grammar rows' list, their
  raw logits kept for the check);
* ``check``: ``Engine._check_draws`` without ``redraw`` (the grammar checks and advances);
* ``forced``: ``Engine.draw_forced`` without ``forced_draws`` and ``to_host``;
* ``forced_draws``: ``RowSampler.forced_draws`` without ``among`` (the forced positions' candidates,
  their upload where each row has one); ``among``: ``RowSampler._argmax_among`` (its gather);
* ``ban``: ``FinishStep.ban_early_stops`` (the plain arm's ``ignore_eos`` mask: a logits clone;
  grammar rows skip it); ``to_host``: the draws' host copy and its event;
* ``finish``: ``FinishStep.apply`` (accept, the finish reason's grammar questions, detokenizer);
* ``resolve``: ``Engine.resolve`` without the above;
* ``step``: the rest of ``BatchScheduler.step``.

    PYTHONPATH=<tree>/src .venv/bin/python docs/benchmarks/data/2026-12-04-cpu-constrained-host/host_phases.py \
        [-b 32] [-n 48] [--rounds 3]

Prints the minimum over rounds of each phase's per-round median (us per row-step), each arm, and
``grammar``: the constrained arm's sum of the mostly-Python phases minus the plain arm's.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "scripts"))
import profile_constrained_host as pch  # noqa: E402
from monobatch.bench import synth_prompt  # noqa: E402
from monobatch.engine import engine as engine_mod  # noqa: E402
from monobatch.engine.engine import Engine  # noqa: E402
from monobatch.engine.finish import FinishStep  # noqa: E402
from monobatch.engine.sampler import RowSampler  # noqa: E402
from monobatch.engine.scheduler import BatchScheduler  # noqa: E402
from monobatch.loader import load_model  # noqa: E402

PHASES = {"step": (BatchScheduler, "step"), "launch_ahead": (BatchScheduler, "_launch_ahead"),
          "launch": (Engine, "launch"), "forward": (Engine, "forward"), "draw_async": (Engine, "_draw_async"),
          "sample": (RowSampler, "draw"), "check": (Engine, "_check_draws"), "redraw": (RowSampler, "redraw"),
          "forced": (Engine, "draw_forced"), "forced_draws": (RowSampler, "forced_draws"),
          "among": (RowSampler, "_argmax_among"), "finish": (FinishStep, "apply"), "resolve": (Engine, "resolve"),
          "ban": (FinishStep, "ban_early_stops"), "to_host": (engine_mod, "_to_host")}
HOST = ("launch_ahead", "launch", "draw_async", "check", "forced", "forced_draws", "finish", "resolve", "step")

acc: dict[str, float] = {k: 0.0 for k in PHASES}
stack: list[list] = []  # [phase, start, child time]


def timed(name, fn):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        stack.append([name, t0, 0.0])
        try:
            return fn(*a, **kw)
        finally:
            _, start, child = stack.pop()
            total = time.perf_counter() - start
            acc[name] += total - child
            if stack:
                stack[-1][2] += total
    return wrapper


for name, (owner, attr) in PHASES.items():
    fn = getattr(owner, attr)
    setattr(owner, attr, staticmethod(timed(name, fn)) if isinstance(owner.__dict__.get(attr), staticmethod)
            else timed(name, fn))

ap = argparse.ArgumentParser()
ap.add_argument("-b", type=int, default=32)
ap.add_argument("-n", type=int, default=48)
ap.add_argument("-p", type=int, default=64)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--json", default=None)
ns = ap.parse_args()
torch.set_num_threads(1)
loaded = load_model(None, device="cpu", dtype="float32", progress=False)
prompts = [synth_prompt(loaded.tokenizer, ns.p, seed=i) for i in range(ns.b)]
pch.one_round(loaded, prompts[:2], 8, True, 0)

# one timed step = one call of BatchScheduler.step that one_round counts (its condition, asked first)
real_step = BatchScheduler.step
samples: list[dict[str, float]] = []


def step(self):
    decoding = self._nstep >= 6 and self._pending is not None and not self.waiting
    self._nstep += 1
    for k in acc:
        acc[k] = 0.0
    out = real_step(self)
    if decoding and out:
        samples.append(dict(acc))
    return out


BatchScheduler.step = step
BatchScheduler._nstep = 0
res = {False: [], True: []}
for r in range(ns.rounds):
    for constrained in (False, True):
        samples.clear()
        pch.one_round(loaded, prompts, ns.n, constrained, 6)
        med = {k: statistics.median(s[k] for s in samples) / ns.b * 1e6 for k in PHASES}
        med["host"] = statistics.median(sum(s[k] for k in HOST) for s in samples) / ns.b * 1e6
        res[constrained].append(med)
        print(f"round {r} {'constrained' if constrained else 'plain      '} ({len(samples)} steps): "
              + " ".join(f"{k} {v:.2f}" for k, v in med.items()), flush=True)
best = {c: {k: min(m[k] for m in res[c]) for k in res[c][0]} for c in res}
print("min of round medians, us per row-step:")
for c in (False, True):
    print(f"  {'constrained' if c else 'plain      '}: " + " ".join(f"{k} {v:.2f}" for k, v in best[c].items()))
print(f"B={ns.b}: host (mostly-Python phases) plain {best[False]['host']:.2f}, constrained {best[True]['host']:.2f}; "
      f"grammar {best[True]['host'] - best[False]['host']:.2f} us per row-step")
if ns.json:
    Path(ns.json).write_text(json.dumps({"rounds": {str(k): v for k, v in res.items()}, "best": {str(k): v for k, v in best.items()}}))
