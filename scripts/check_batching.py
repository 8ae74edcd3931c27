"""Check the batching invariants on any device and print a JSON report (used on the GPU, where
the test suite does not run): paged = dense at B=1 (greedy ids); under --deterministic, 8 prompts
alone / as one batch / as one batch with prefill chunks of 5 give identical ids on both storages,
and a prefix-cache hit equals the cold run; in the default mode, where batched ids differ from
alone, the first divergent index and the top-2 logit margin there. Where CUDA graphs apply
(CUDA, paged, default mode), graph-replayed decode steps against eager ones, alone and batched.
``--shape NAME``: random weights of a named shape instead of a checkpoint (no model file needed).
``--deterministic``: the deterministic-mode checks only. ``--long``: also long prompts whose rows
cross deterministic mode's KV split sizes (:func:`long_lengths`: the positions where
``kernels.varlen_attention.split_size`` changes, taken from that function itself, so they follow
``MONOBATCH_DET_SPLIT``; with the default ``128,32``, 128 keys a split up to position 4,095, 256
from 4,096, 512 from 8,192): alone / batched / chunked / on a pool small enough to preempt,
on both storages, ids and logprobs bit for bit; and each continued as a new prompt (its
generated tokens, first computed as decode rows, recomputed as prompt rows, cold and on a
prefix-cache hit) giving the rest of the same tokens and logprobs.

    PYTHONPATH=src python3 scripts/check_batching.py --model SmolLM2-135M-Instruct.Q4_1.gguf --device cuda
    PYTHONPATH=src python3 scripts/check_batching.py --shape llama-1b --device cuda --deterministic --long
    # a quick run on CPU: split changes at 128 and 256 keys, so the long prompts are short
    MONOBATCH_DET_SPLIT=128,1 PYTHONPATH=src python3 scripts/check_batching.py --device cpu --deterministic --long -n 8
"""

from __future__ import annotations

import argparse
import json
import random

from monobatch import LLM, SamplingParams
from monobatch.engine.engine import Engine
from monobatch.kernels.varlen_attention import SPLIT_MIN, SPLIT_PARTS, split_size
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


def deterministic_checks(report: dict, run, a, b, loaded, greedy) -> None:
    """Under --deterministic: alone / batched / chunked on both storages equal, a prefix hit equal to cold."""
    ref = run("dense", True, batch=False)
    for storage in ("dense", "paged"):
        report[f"deterministic_{storage}_alone_equal"] = run(storage, True, batch=False) == ref
        report[f"deterministic_{storage}_batch_equal"] = run(storage, True) == ref
        report[f"deterministic_{storage}_chunked_batch_equal"] = run(storage, True, chunk=5) == ref
    cold = run("paged", True, batch=False, ps=[b])[0]
    llm = LLM(loaded=loaded, deterministic=True)
    llm.generate([a], greedy, use_tqdm=False)
    warm = llm.generate([b], greedy, use_tqdm=False)[0]
    report["deterministic_prefix_hit_tokens"] = warm.num_cached_tokens
    report["deterministic_prefix_hit_equals_cold"] = warm.outputs[0].token_ids == cold
    report["deterministic_prefix_hit_divergence"] = divergences(Engine(loaded), [b], [cold], [warm.outputs[0].token_ids])


#: --long straddles this many of the first split size changes (4,096 and 8,192 keys by default).
LONG_SPLIT_CHANGES = 2
#: --long's short prompt, batched beside the long ones (at most half the first change).
LONG_SHORT = 700


def split_changes(end: int, windows=(0,)) -> list[int]:
    """Positions ``p < end`` whose deterministic KV split size differs from position ``p - 1``'s on
    some layer (``kernels.varlen_attention.split_size``, the kernel's own rule, under this
    process's ``MONOBATCH_DET_SPLIT``; ``windows``: the layers' sliding windows, 0 for none)."""
    return sorted({p for w in set(windows) or {0} for p in range(1, end)
                   if split_size(p, w) != split_size(p - 1, w)})


def long_lengths(limit: int, n: int, windows=(0,)) -> list[int]:
    """--long's prompt lengths (at most ``limit``, for ``n`` generated tokens): for each of the
    first :data:`LONG_SPLIT_CHANGES` split size changes ``c``, a prompt ending ``n // 2`` before
    it (its decode rows cross ``c``) and one ending ``n // 2`` past it (its prompt rows straddle
    ``c``), and a short one beside them (below the first change); just ``limit`` when the context
    reaches no change."""
    changes = split_changes(limit + n, windows)[:LONG_SPLIT_CHANGES]
    lengths = [min(LONG_SHORT, limit, *(c // 2 for c in changes[:1]))]  # below the first change
    for c in changes:
        lengths += [m for m in (c - n // 2, c + n // 2) if 0 < m <= limit and m not in lengths]
    return lengths if len(lengths) > 1 else [limit]


def long_checks(loaded, n: int, rng: random.Random) -> dict:
    """--long (deterministic mode): see the module docstring. Returns the report's entries."""
    limit = loaded.model.args.max_position_embeddings - n - 1
    windows = loaded.model.args.layer_windows()
    lengths = long_lengths(limit, n, windows)
    vocab = loaded.tokenizer.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(m)] for m in lengths]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    report: dict = {"long_prompt_lengths": lengths, "long_split": [SPLIT_MIN, SPLIT_PARTS],
                    "long_split_changes": split_changes(limit + n, windows)[:LONG_SPLIT_CHANGES],
                    # keys a split at each prompt's first decode row and at its last row (full-attention layers)
                    "long_split_sizes": [[split_size(m), split_size(m + n - 1)] for m in lengths]}

    def gen(llm, ps):
        return [(o.outputs[0].token_ids, [lp for _, lp, _ in o.outputs[0].logprobs])
                for o in llm.generate(ps, params, use_tqdm=False)]

    # every engine here lives to the end: a bounded paged pool each (twice the batch's tokens), not the
    # default share of the free GPU memory, which the second engine would find taken (H200, 2026-12-02)
    # (at least two contexts: the engine refuses a pool smaller than one, and short --long prompts,
    # as under a small MONOBATCH_DET_SPLIT, would size it below that)
    pool = 2 * max(sum(lengths) + len(lengths) * (n + 1) + 1024, limit + n + 1) * loaded_kv_bytes_per_token(loaded)

    def llm_for(storage="paged", **kw):
        if storage == "paged":
            kw.setdefault("kv_cache_memory", pool)
        return LLM(loaded=loaded, kv_storage=storage, deterministic=True, max_model_len=limit + n + 1, **kw)

    ref = [gen(llm_for("dense"), [p])[0] for p in prompts]  # each alone, dense, one prompt chunk of 2,048
    for storage in ("dense", "paged"):
        report[f"long_{storage}_batch_equal"] = gen(llm_for(storage), prompts) == ref
        report[f"long_{storage}_chunked_batch_equal"] = gen(llm_for(storage, prefill_chunk=777), prompts) == ref
    # a pool of little more than one context: sequences wait and are preempted (recomputed as prompts)
    small = llm_for("paged", kv_cache_memory=(limit + n + 1 + 256) * loaded_kv_bytes_per_token(loaded))
    report["long_small_pool_equal"] = gen(small, prompts) == ref
    report["long_small_pool_preemptions"] = small.scheduler.stats().num_preemptions
    # continued as new prompts: tokens decoded before, now prompt rows (cold, then on a prefix hit)
    half = n // 2
    more = [p + ids_[:half] for p, (ids_, _) in zip(prompts, ref)]
    want = [(ids_[half:], lps[half:]) for ids_, lps in ref]
    params_rest = SamplingParams(temperature=0, max_tokens=n - half, ignore_eos=True, logprobs=0)
    for name, llm in (("cold", llm_for("paged")), ("dense", llm_for("dense"))):
        got = [(o.outputs[0].token_ids, [lp for _, lp, _ in o.outputs[0].logprobs])
               for o in llm.generate(more, params_rest, use_tqdm=False)]
        report[f"long_continued_{name}_equal"] = got == want
    warm = llm_for("paged")
    gen(warm, prompts)  # caches every prompt's blocks
    outs = warm.generate(more, params_rest, use_tqdm=False)
    got = [(o.outputs[0].token_ids, [lp for _, lp, _ in o.outputs[0].logprobs]) for o in outs]
    report["long_continued_prefix_hit_tokens"] = [o.num_cached_tokens for o in outs]
    report["long_continued_prefix_hit_equal"] = got == want
    return report


def loaded_kv_bytes_per_token(loaded) -> int:
    """KV bytes of one token across all layers (K and V) in the model's dtype."""
    args = loaded.model.args
    return 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * loaded.model.dtype.itemsize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("-n", type=int, default=32, help="tokens per request")
    ap.add_argument("--shape", help="random weights of this shape (monobatch.models.shapes) instead of --model")
    ap.add_argument("--deterministic", action="store_true", help="only the deterministic-mode checks")
    ap.add_argument("--long", action="store_true", help="also long prompts across the KV split sizes (see above)")
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

    if ns.long:
        report.update(long_checks(loaded, ns.n, rng))
    if ns.deterministic:
        deterministic_checks(report, run, a, b, loaded, greedy)
        print(json.dumps(report, indent=1))
        return
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
    deterministic_checks(report, run, a, b, loaded, greedy)
    cold = run("paged", False, batch=False, ps=[b])[0]
    llm = LLM(loaded=loaded)
    llm.generate([a], greedy, use_tqdm=False)
    warm = llm.generate([b], greedy, use_tqdm=False)[0]
    report["default_prefix_hit_tokens"] = warm.num_cached_tokens
    report["default_prefix_hit_equals_cold"] = warm.outputs[0].token_ids == cold
    report["default_prefix_hit_divergence"] = divergences(Engine(loaded), [b], [cold], [warm.outputs[0].token_ids])
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
