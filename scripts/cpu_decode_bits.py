"""Bitwise before/after check of CPU forward outputs (issue 17's host-work pass): every logits
tensor the model returns over a few greedy runs — prompts of 1..~60 tokens, B=1 and a batch of 3,
paged and dense KV, the default and the deterministic mode — saved to a file, or compared with one
saved before a change (``--compare``: exits 1 unless every tensor is bitwise equal).

    PYTHONPATH=src .venv/bin/python scripts/cpu_decode_bits.py --save /tmp/before.pt
    PYTHONPATH=src .venv/bin/python scripts/cpu_decode_bits.py --compare /tmp/before.pt
    PYTHONPATH=src .venv/bin/python scripts/cpu_decode_bits.py -m gemma3 --save /tmp/g.pt   # Gemma 3 270M
"""

from __future__ import annotations

import argparse
import sys

import torch

from monobatch.engine.engine import Engine, EngineConfig
from monobatch.engine.params import SamplingParams
from monobatch.engine.scheduler import BatchScheduler
from monobatch.engine.sequence import Request
from monobatch.loader import load_model

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who " * 3]


def runs(model: str | None, n: int) -> dict[str, list[torch.Tensor]]:
    loaded = load_model(model, "cpu", progress=False)
    out: dict[str, list[torch.Tensor]] = {}
    for det in (False, True):
        for storage in ("paged", "dense"):
            engine = Engine(loaded, EngineConfig(kv_storage=storage, deterministic=det))
            got: list[torch.Tensor] = []
            hook = engine.model.register_forward_hook(lambda m, i, o: got.append(o.detach().clone()))
            ids = [engine.tokenizer.encode(p) for p in PROMPTS]
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            for name, group in (("b1", [ids[0]]), ("b1long", [ids[2]]), ("b3", ids)):
                got.clear()
                sched = BatchScheduler(engine)
                reqs = [Request(f"{name}{i}", p, params, bypass_prefix_cache=True) for i, p in enumerate(group)]
                for _ in sched.run(reqs):
                    pass
                out[f"{'det' if det else 'fast'}/{storage}/{name}"] = list(got)
            hook.remove()
            engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-n", type=int, default=24, help="greedy tokens a request")
    ap.add_argument("-t", "--threads", type=int, default=1)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--save")
    g.add_argument("--compare")
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    got = runs(ns.model, ns.n)
    if ns.save:
        torch.save(got, ns.save)
        print(f"saved {sum(len(v) for v in got.values())} logits tensors to {ns.save}")
        return
    ref = torch.load(ns.compare)
    bad = 0
    for key, tensors in ref.items():
        mine = got.get(key, [])
        same = len(mine) == len(tensors) and all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(mine, tensors))
        diff = max(((a - b).abs().max().item() for a, b in zip(mine, tensors) if a.shape == b.shape), default=float("nan"))
        print(f"{key}: {len(tensors)} steps, {'bitwise equal' if same else f'DIFFERENT (max |d| {diff:.3g})'}")
        bad += not same
    print("ALL BITWISE EQUAL" if not bad else f"{bad} runs differ")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
