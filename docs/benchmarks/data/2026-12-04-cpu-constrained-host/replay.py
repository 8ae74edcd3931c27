"""The grammar work of a constrained row-step replayed on the host alone: 32 JSON answers of the
bundled model (greedy, ``bench --constrained``'s schema) are decoded once; then fresh matchers
walk the same tokens step by step, each row-step doing what the async path does to a row
(``GrammarMatcher.advance_if_allowed`` through ``RowSampler.check_picks``, ``SamplerState.accept``
via ``FinishStep``-like calls, ``is_stopped``, ``forced_candidates``), against the bare llguidance
calls of the same walk (``try_consume_tokens``, ``is_stopped``, ``compute_ff_bytes``,
``is_stopped``). The difference is the Python around the llguidance calls, per row-step.

    PYTHONPATH=<tree>/src .venv/bin/python docs/benchmarks/data/2026-12-04-cpu-constrained-host/replay.py [--reps 7]
"""
import argparse
import statistics
import time

import torch

from monobatch.bench import bench_constraint, synth_prompt
from monobatch.engine.engine import Engine, EngineConfig
from monobatch.engine.params import SamplingParams
from monobatch.engine.sampler import RowSampler, SamplerState
from monobatch.engine.scheduler import BatchScheduler
from monobatch.engine.sequence import Request
from monobatch.loader import load_model

ap = argparse.ArgumentParser()
ap.add_argument("--reps", type=int, default=7)
ns = ap.parse_args()
torch.set_num_threads(1)
loaded = load_model(None, device="cpu", dtype="float32", progress=False)
engine = Engine(loaded, EngineConfig(async_scheduling=True, max_num_seqs=32))
sched = BatchScheduler(engine)
spec = bench_constraint()
params = SamplingParams(temperature=0.0, max_tokens=48, structured=spec)
for i in range(32):
    sched.add_request(Request(f"r{i}", synth_prompt(loaded.tokenizer, 64, seed=i), params, bypass_prefix_cache=True))
toks: dict[str, list[int]] = {}
while sched.has_unfinished():
    for o in sched.step():
        toks.setdefault(o.request_id, []).extend(o.token_ids)
streams = [toks[f"r{i}"] for i in range(32)]
steps = max(map(len, streams))
print(f"{len(streams)} answers, {sum(map(len, streams))} tokens, {steps} steps")


def engine_path():
    states = [SamplerState(params, [1], 0, grammar=engine.grammars.matcher(spec)) for _ in streams]
    t = 0.0
    n = 0
    for k in range(steps):
        rows = [r for r, s in enumerate(streams) if k < len(s)]
        picks = [s[k] if k < len(s) else 0 for s in streams]
        t0 = time.perf_counter()
        refused = RowSampler.check_picks(states, picks, rows, None, advance=True)
        for r in rows:
            st = states[r]
            st.accept(picks[r])
            st.grammar.is_stopped  # noqa: B018 (the finish reason's question)
        for r in rows:
            g = states[r].grammar
            if not g.is_stopped:
                g.forced_candidates()
        t += time.perf_counter() - t0
        n += len(rows)
        assert not refused
    return t / n


def bare_path():
    ms = [engine.grammars.matcher(spec).raw for _ in streams]
    t = 0.0
    n = 0
    for k in range(steps):
        rows = [r for r, s in enumerate(streams) if k < len(s)]
        t0 = time.perf_counter()
        for r in rows:
            ms[r].try_consume_tokens([streams[r][k]])
            ms[r].is_stopped()
        for r in rows:
            m = ms[r]
            if not m.is_stopped():
                m.compute_ff_bytes()
                m.is_stopped()
        t += time.perf_counter() - t0
        n += len(rows)
    return t / n


res = {"engine": [], "bare": []}
for _ in range(ns.reps):
    res["engine"].append(engine_path() * 1e6)
    res["bare"].append(bare_path() * 1e6)
e, b = min(res["engine"]), min(res["bare"])
print("engine path us/row-step:", " ".join(f"{x:.2f}" for x in res["engine"]))
print("bare llguidance us/row-step:", " ".join(f"{x:.2f}" for x in res["bare"]))
print(f"min: engine {e:.2f}, bare {b:.2f}, python around the calls {e - b:.2f} us per row-step")
