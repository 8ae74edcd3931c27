"""Check the batching invariants on any device and print a JSON report (used on the GPU, where
the test suite does not run): paged = dense at B=1 (greedy ids); under --deterministic, 8 prompts
alone / as one batch / as one batch with prefill chunks of 5 give identical ids on both storages,
and a prefix-cache hit equals the cold run; in the default mode, where batched ids differ from
alone, the first divergent index and the top-2 logit margin there. Where CUDA graphs apply
(CUDA, paged, default mode), graph-replayed decode steps against eager ones, alone and batched.
``--shape NAME``: random weights of a named shape instead of a checkpoint (no model file needed).

    PYTHONPATH=src python3 scripts/check_batching.py --model SmolLM2-135M-Instruct.Q4_1.gguf --device cuda
"""

from __future__ import annotations

import argparse
import json
import random

from monobatch import LLM, SamplingParams
from monobatch.engine.engine import Engine
from monobatch.loader import load_model
from monobatch.loader.dummy import dummy_model

TEXTS = ["The quick brown fox", "In 1969, the first humans", "import numpy as np\n", "Roses are red,",
         "The three primary colours are", "def fibonacci(n):", "Once upon a time", "The capital of France is"]
SYSTEM = ("You are a careful assistant. Answer briefly and precisely, name your sources when you can, and say so when "
          "you do not know the answer to a question. Keep every reply under fifty words, use plain language, and never "
          "invent facts, numbers or quotations.")


def ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def divergences(engine: Engine, prompts, ref, got) -> list[dict]:
    report = []
    for p, a, b in zip(prompts, ref, got):
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is not None:
            report.append({"index": i, "ref": a[i], "got": b[i], "top2_margin": round(engine.top2_margin(p + a[:i]), 5)})
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("-n", type=int, default=32, help="tokens per request")
    ap.add_argument("--shape", help="random weights of this shape (monobatch.models.shapes) instead of --model")
    ns = ap.parse_args()
    loaded = dummy_model(ns.shape, ns.device) if ns.shape else load_model(ns.model, ns.device, None, progress=False)
    tok = loaded.tokenizer
    rng = random.Random(0)
    if ns.shape:  # a synthetic vocabulary: random ids of the prompts' lengths, a shared 40-token prefix
        prompts = [[rng.randrange(1, tok.vocab_size) for _ in range(4 + 3 * i)] for i in range(len(TEXTS))]
        prefix = [rng.randrange(1, tok.vocab_size) for _ in range(40)]
        a, b = prefix + [11, 12, 13], prefix + [21, 22, 23]
    else:
        prompts = [tok.encode(t) for t in TEXTS]
        a = tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}])
        b = tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a fruit."}])
    greedy = SamplingParams(temperature=0, max_tokens=ns.n)
    report: dict = {"device": str(loaded.model.device), "dtype": str(loaded.model.dtype), "tokens": ns.n}

    def run(storage, det, batch=True, chunk=2048, ps=prompts, eager=False):
        llm = LLM(loaded=loaded, kv_storage=storage, deterministic=det, prefill_chunk=chunk, enforce_eager=eager)
        if batch:
            return ids(llm.generate(ps, greedy, use_tqdm=False))
        return [ids(llm.generate([p], greedy, use_tqdm=False))[0] for p in ps]

    dense_b1, paged_b1 = run("dense", False, batch=False), run("paged", False, batch=False)
    report["default_paged_equals_dense_b1"] = dense_b1 == paged_b1
    fast_batch = run("paged", False)
    if Engine(loaded).graphs is not None:
        eager_b1, eager_batch = run("paged", False, batch=False, eager=True), run("paged", False, eager=True)
        report["graphs_b1_equal_eager"] = paged_b1 == eager_b1
        report["graphs_b1_divergences"] = divergences(Engine(loaded), prompts, eager_b1, paged_b1)
        report["graphs_batch_equal_eager"] = fast_batch == eager_batch
        report["graphs_batch_divergences"] = divergences(Engine(loaded), prompts, eager_batch, fast_batch)
    report["default_batch_equals_alone"] = fast_batch == paged_b1
    report["default_batch_divergences"] = divergences(Engine(loaded), prompts, paged_b1, fast_batch)
    ref = run("dense", True, batch=False)
    for storage in ("dense", "paged"):
        report[f"deterministic_{storage}_alone_equal"] = run(storage, True, batch=False) == ref
        report[f"deterministic_{storage}_batch_equal"] = run(storage, True) == ref
        report[f"deterministic_{storage}_chunked_batch_equal"] = run(storage, True, chunk=5) == ref
    for det in (True, False):
        cold = run("paged", det, batch=False, ps=[b])[0]
        llm = LLM(loaded=loaded, deterministic=det)
        llm.generate([a], greedy, use_tqdm=False)
        warm = llm.generate([b], greedy, use_tqdm=False)[0]
        key = "deterministic" if det else "default"
        report[f"{key}_prefix_hit_tokens"] = warm.num_cached_tokens
        report[f"{key}_prefix_hit_equals_cold"] = warm.outputs[0].token_ids == cold
        report[f"{key}_prefix_hit_divergence"] = divergences(Engine(loaded), [b], [cold], [warm.outputs[0].token_ids])
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
