"""TP=N against TP=1 on any device (ADR 0007): greedy and seeded tokens of a few prompts and the
logits of every prompt position, for random weights of a named shape (or the bundled model).
Prints one JSON object; exit 1 when --deterministic and anything differs.

    PYTHONPATH=src python3 scripts/check_tp.py --shape llama-1b --device cuda --tp 2 --deterministic
    .venv/bin/python scripts/check_tp.py --tp 2 -t 1            # the bundled model on CPU (gloo)
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", help="random weights of this shape (default: the bundled model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("-n", type=int, default=32, help="tokens per request")
    p.add_argument("-t", "--threads", type=int, default=0)
    ns = p.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    from monobatch.engine.params import SamplingParams
    from monobatch.llm import LLM
    from monobatch.loader import load_model
    from monobatch.loader.dummy import dummy_model

    loaded = dummy_model(ns.shape, ns.device) if ns.shape else load_model(None, ns.device, "auto", progress=False)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11], list(range(100, 160))]
    params = [SamplingParams(max_tokens=ns.n, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=ns.n, temperature=0.8, seed=7, top_k=40, ignore_eos=True)]
    runs = {}
    for tp in (1, ns.tp):
        llm = LLM(loaded=loaded, deterministic=ns.deterministic, tensor_parallel_size=tp)
        engine = llm.scheduler.engine
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts * 2], [params[0]] * 3 + [params[1]] * 3)
        runs[tp] = ([o.outputs[0].token_ids for o in outs], engine.prompt_logits(prompts[2], all_positions=True).cpu(),
                    engine.describe())
        engine.close()
    (a, la, _), (b, lb, desc) = runs[1], runs[ns.tp]
    same = [x == y for x, y in zip(a, b)]
    report = {"shape": ns.shape or "bundled", "device": str(loaded.model.device), "tp": ns.tp,
              "deterministic": ns.deterministic, "engine": desc, "requests_identical": sum(same),
              "requests": len(same), "logits_bitwise": bool(torch.equal(la, lb)),
              "logits_max_abs_diff": float((la - lb).abs().max())}
    print(json.dumps(report))
    return 1 if ns.deterministic and not (all(same) and report["logits_bitwise"]) else 0


if __name__ == "__main__":
    sys.exit(main())
