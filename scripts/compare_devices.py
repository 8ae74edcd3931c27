"""Greedy tokens on CUDA (bfloat16) against CPU (float32) for the bundled model.

For each prompt: generate N greedy tokens through the engine on both devices, report how many
match and, at the first divergence, both token ids and each side's top-2 logit margin there.
Usage: PYTHONPATH=src python scripts/compare_devices.py [--model PATH] [-n 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json

from monobatch.engine.engine import Engine
from monobatch.engine.params import SamplingParams
from monobatch.engine.scheduler import BatchScheduler
from monobatch.engine.sequence import Request
from monobatch.loader import load_model

PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "Explain what a hash table is."]


def greedy(scheduler: BatchScheduler, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    for o in scheduler.run([Request("x", ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))]):
        out += o.token_ids
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--json")
    ns = ap.parse_args()
    cpu = load_model(ns.model, "cpu", "float32", progress=False)
    gpu = load_model(ns.model, "cuda", "bfloat16", progress=False)
    rows = []
    for text in PROMPTS:
        ids = cpu.tokenizer.encode_chat([{"role": "user", "content": text}])
        a = greedy(BatchScheduler(Engine(cpu)), ids, ns.n)
        b = greedy(BatchScheduler(Engine(gpu)), ids, ns.n)
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        row = {"prompt": text, "tokens": ns.n, "matching_prefix": ns.n if i is None else i}
        if i is not None:
            row |= {"cpu_token": a[i], "cuda_token": b[i],
                    "cpu_top2_margin": Engine(cpu).top2_margin(ids + a[:i]),
                    "cuda_top2_margin": Engine(gpu).top2_margin(ids + a[:i])}
        rows.append(row)
        print(json.dumps(row))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
