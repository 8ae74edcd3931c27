"""Host time per row and decode step of batched decode, split by phase, on CPU (issue 16: on the
H200 batched decode at B >= 64 is host-bound, ~28-30 us of host time a row and step).

The model is the ``tiny`` random-weight shape (2 layers, vocabulary 512), so its forward costs
little; the forward is timed and left out. Every other piece of :meth:`BatchScheduler.step` is
timed on its own (exclusive time: a phase's time excludes the phases it calls):

* ``schedule``: :meth:`BatchScheduler._schedule` / ``_launch_ahead`` (KV reservations, chunk lists)
  without ``build``;
* ``build``: :meth:`Engine.build_batch` (StepBatch.build and its tensors);
* ``kv_prepare``: the paged store's ``prepare`` (checks, slot mapping and block tables of the CPU
  kernel), or with ``--graphs`` the CUDA-graph decode path's ``prepare_decode`` (the GPU's: the
  static host buffer's slots, lengths and block tables), run on CPU without a graph;
* ``kv_commit``: the paged store's commit of the step's tokens (``PagedKv.commit``, when the caller
  commits: async scheduling commits the step launched ahead);
* ``ban``: :meth:`FinishStep.ban_early_stops`;
* ``plan``: the sampler's host plan of a step with sampled rows (``sampler._Plan``: which rows
  use which stage, their parameters and RNG keys);
* ``sample``: the rest of the sampler's draw (``RowSampler.draw`` / ``sample``: its plan and its torch ops,
  which on CPU compute here);
* ``resolve``: :meth:`Engine.resolve` without the finish step (the host copy of the draws);
* ``finish``: :meth:`FinishStep.apply` (append, accept, stop checks, detokenize, outputs);
* ``after``: :meth:`BatchScheduler._after_step` (counters, freeing finished sequences);
* ``other``: the rest of ``step`` (the loop's own code).

Rows: B requests of random short prompts, plain greedy (``greedy``) or sampled at temperature 0.8,
top_p 0.95 and a seed (``sampled``), each generating ``-n`` tokens (EOS ignored by none: the
synthetic vocabulary has no EOS). The loop runs async scheduling (the path the GPU takes) unless
``--sync``; ``--graphs`` runs decode steps through the CUDA-graph path (the GPU's).
Arms run in interleaved rounds; each prints the minimum over rounds of the per-round
median of each phase, in us per row-step.

    PYTHONPATH=src .venv/bin/python scripts/profile_host_rows.py [-b 32,128,256] [-n 48] [--rounds 5] \
        [--graphs] [--sync]
    PYTHONPATH=src .venv/bin/python scripts/profile_host_rows.py -b 128 --cprofile sampled   # + top functions
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import random
import statistics
import time

import torch

from monobatch.engine import sampler as sampler_mod
from monobatch.engine.engine import Engine, EngineConfig
from monobatch.engine.params import SamplingParams
from monobatch.engine.scheduler import BatchScheduler
from monobatch.engine.sequence import Request
from monobatch.loader.dummy import dummy_model

PHASES = ("schedule", "build", "kv_prepare", "kv_commit", "ban", "plan", "sample", "resolve", "finish", "after",
          "other")


class Phases:
    """Exclusive wall time of nested named phases (a stack of open phases)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = dict.fromkeys((*PHASES, "forward"), 0.0)
        self.stack: list[list] = []  # [name, start, time in children]

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            self.stack.append([name, time.perf_counter(), 0.0])
            try:
                return fn(*a, **k)
            finally:
                _, t0, inner = self.stack.pop()
                dt = time.perf_counter() - t0
                self.total[name] += dt - inner
                if self.stack:
                    self.stack[-1][2] += dt
        return timed

    def reset(self) -> None:
        for k in self.total:
            self.total[k] = 0.0


def one_round(loaded, prompts: list[list[int]], n: int, sampled: bool, sync: bool, warm: int,
              prof: cProfile.Profile | None = None, graphs: bool = False) -> dict[str, list[float]]:
    """Per decode step that delivered tokens (after ``warm`` steps): seconds by phase."""
    gc.collect()
    engine = Engine(loaded, EngineConfig(async_scheduling=not sync, max_num_seqs=len(prompts),
                                         max_num_batched_tokens=max(len(prompts), 2048)))
    if graphs:  # the CUDA-graph decode path's static buffers, run without a graph (as CPU tests do)
        from monobatch.engine.cuda_graphs import DecodeGraphs

        engine.graphs = DecodeGraphs(engine.model, engine.kv, max_batch=len(prompts), capture=False)
    sched = BatchScheduler(engine)
    for i, p in enumerate(prompts):
        params = (SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=n) if sampled
                  else SamplingParams(temperature=0.0, max_tokens=n))
        sched.add_request(Request(f"r{i}", p, params))
    ph = Phases()
    sched._schedule = ph.wrap("schedule", sched._schedule)
    sched._launch_ahead = ph.wrap("schedule", sched._launch_ahead)
    sched._after_step = ph.wrap("after", sched._after_step)
    engine.build_batch = ph.wrap("build", engine.build_batch)
    engine.forward = ph.wrap("forward", engine.forward)
    engine.kv.commit = ph.wrap("kv_commit", engine.kv.commit)
    engine.kv.prepare = ph.wrap("kv_prepare", engine.kv.prepare)
    engine.kv.prepare_decode = ph.wrap("kv_prepare", engine.kv.prepare_decode)
    engine.resolve = ph.wrap("resolve", engine.resolve)
    engine.finisher.ban_early_stops = ph.wrap("ban", engine.finisher.ban_early_stops)
    engine.finisher.apply = ph.wrap("finish", engine.finisher.apply)
    engine.sampler.draw = ph.wrap("sample", engine.sampler.draw)
    engine.sampler.sample = ph.wrap("sample", engine.sampler.sample)
    plan_init = sampler_mod._Plan.__init__
    sampler_mod._Plan.__init__ = ph.wrap("plan", plan_init)
    step = ph.wrap("other", sched.step)
    out: dict[str, list[float]] = {k: [] for k in (*PHASES, "host")}
    steps = 0
    while sched.has_unfinished():
        ph.reset()
        timed = steps >= warm and not sched.waiting and all(s.num_uncomputed <= 1 for s in sched.running)
        if timed and prof is not None:
            prof.enable()
        outs = step()
        if timed and prof is not None:
            prof.disable()
        # a full step of B rows (not the tail, where rows finish and the batch shrinks)
        if timed and len(outs) == len(prompts) and not any(o.finished for o in outs):
            for k in PHASES:
                out[k].append(ph.total[k])
            out["host"].append(sum(ph.total[k] for k in PHASES))
        steps += 1
    sampler_mod._Plan.__init__ = plan_init
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-b", "--batch", default="32,128,256", help="batch sizes, comma-separated")
    ap.add_argument("-n", type=int, default=48, help="tokens per request")
    ap.add_argument("-p", type=int, default=24, help="most prompt tokens (random lengths 8..p)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warm", type=int, default=4, help="steps skipped at the start")
    ap.add_argument("--arms", default="greedy,sampled")
    ap.add_argument("--sync", action="store_true", help="the synchronous loop (CPU's default) instead of async")
    ap.add_argument("--graphs", action="store_true",
                    help="decode steps through the CUDA-graph path's static buffers (DecodeGraphs, capture off): "
                         "PagedKv.prepare_decode, what the GPU runs, instead of the CPU's prepare")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--cprofile", choices=("greedy", "sampled"), help="cProfile one round of this arm (largest B)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    loaded = dummy_model(ns.shape, "cpu", "float32")
    sizes = [int(b) for b in ns.batch.split(",")]
    arms = ns.arms.split(",")
    rng = random.Random(0)
    vocab = loaded.model.args.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(8, ns.p))] for _ in range(max(sizes))]
    one_round(loaded, prompts[:8], 8, True, ns.sync, 0, graphs=ns.graphs)  # imports, first calls
    med: dict[tuple[int, str], list[dict[str, float]]] = {(b, a): [] for b in sizes for a in arms}
    for r in range(ns.rounds):
        for b in sizes:
            for a in arms:
                res = one_round(loaded, prompts[:b], ns.n, a == "sampled", ns.sync, ns.warm, graphs=ns.graphs)
                med[b, a].append({k: statistics.median(v) / b * 1e6 for k, v in res.items()})
                print(f"round {r} B={b} {a}: {len(res['host'])} steps, host {med[b, a][-1]['host']:.2f} us/row-step",
                      flush=True)
    result = {}
    if ns.rounds:
        mode = "sync" if ns.sync else "async"
        print(f"\nus per row-step, min over {ns.rounds} rounds of each round's median ({mode})")
        print(f"{'B':>4} {'arm':8} " + " ".join(f"{k:>9}" for k in (*PHASES, "host")))
    for b in sizes if ns.rounds else ():
        for a in arms:
            best = {k: min(m[k] for m in med[b, a]) for k in (*PHASES, "host")}
            result[f"{b}/{a}"] = best
            print(f"{b:>4} {a:8} " + " ".join(f"{best[k]:9.2f}" for k in (*PHASES, "host")))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"args": vars(ns), "us_per_row_step": result}, f, indent=1)
    if ns.cprofile:
        prof = cProfile.Profile()
        one_round(loaded, prompts[:max(sizes)], ns.n, ns.cprofile == "sampled", ns.sync, ns.warm, prof, ns.graphs)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35)
        print(s.getvalue())


if __name__ == "__main__":
    main()
