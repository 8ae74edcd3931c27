"""Greedy tokens of one model loaded two ways: by default CUDA (bfloat16) against CPU (float32).

For each prompt: generate N greedy tokens through the engine on both sides, report how many
match and, at the first divergence, both token ids and each side's top-2 logit margin there.
A side is ``DEVICE:DTYPE[:WEIGHTS]`` (WEIGHTS ``packed`` or ``dequant``; default: the loader's),
e.g. ``--a cuda:bfloat16:dequant --b cuda:bfloat16:packed`` for issue 17's packed-vs-dequant
check on the GPU (``MONOBATCH_PACKED_GEMV`` picks the GEMV).
Usage: PYTHONPATH=src python scripts/compare_devices.py [--model PATH] [-n 64] [--a SIDE] [--b SIDE] [--json OUT]
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
    ap.add_argument("--a", default="cpu:float32", help="the reference side, DEVICE:DTYPE[:WEIGHTS]")
    ap.add_argument("--b", default="cuda:bfloat16", help="the compared side, DEVICE:DTYPE[:WEIGHTS]")
    ap.add_argument("--json")
    ns = ap.parse_args()

    def side(spec: str):
        """``DEVICE:DTYPE[:WEIGHTS]`` (DEVICE may hold its own colon: ``cuda:1:bfloat16``) -> a model."""
        parts = spec.split(":")
        weights = parts.pop() if parts[-1] in ("packed", "dequant") else None
        if len(parts) < 2 or parts[-1] not in ("float32", "bfloat16", "float16"):
            ap.error(f"{spec!r}: a side is DEVICE:DTYPE[:WEIGHTS], e.g. cuda:bfloat16:packed")
        dtype = parts.pop()
        return load_model(ns.model, ":".join(parts), dtype, progress=False, weights=weights)

    left, right = side(ns.a), side(ns.b)
    print(json.dumps({"a": ns.a, "a_weights": left.weights, "b": ns.b, "b_weights": right.weights}))
    rows = []
    for text in PROMPTS:
        ids = left.tokenizer.encode_chat([{"role": "user", "content": text}])
        a = greedy(BatchScheduler(Engine(left)), ids, ns.n)
        b = greedy(BatchScheduler(Engine(right)), ids, ns.n)
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        row = {"prompt": text, "tokens": ns.n, "matching_prefix": ns.n if i is None else i}
        if i is not None:
            row |= {"a_token": a[i], "b_token": b[i],
                    "a_top2_margin": Engine(left).top2_margin(ids + a[:i]),
                    "b_top2_margin": Engine(right).top2_margin(ids + a[:i])}
        rows.append(row)
        print(json.dumps(row))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
