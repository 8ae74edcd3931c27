"""Where a constrained decode step's host time goes, per batch size: the grammar masks (one
matcher at a time, and llguidance's thread pool) and the matchers' advance (consume_token).

    python scripts/profile_grammar.py TOKENIZER_JSON META_JSON [--batch 1,8,32,64] [--steps 150]

TOKENIZER_JSON is ``Tokenizer.backend_json()`` of the model and META_JSON ``{"vocab_size",
"eog"}`` (so it runs where the GGUF is not); the schema is ``bench --constrained``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import llguidance
import numpy as np

from monobatch.bench import CONSTRAINED_SCHEMA
from monobatch.engine.constraint import JSON_OPTIONS, GrammarMatcher, TokenIndex, fill_bitmasks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tokenizer_json")
    ap.add_argument("meta_json")
    ap.add_argument("--batch", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=150)
    ns = ap.parse_args()
    meta = json.load(open(ns.meta_json))
    V = meta["vocab_size"]
    tok = llguidance.LLTokenizer(open(ns.tokenizer_json).read(), n_vocab=V, eos_token=meta["eog"])
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(CONSTRAINED_SCHEMA), defaults=JSON_OPTIONS)
    template = llguidance.LLMatcher(tok, grammar, log_level=0)
    doc = json.dumps([{"name": f"item{i}", "value": i * 37} for i in range(400)])[:-1]
    ids = tok.tokenize_str(doc)[: ns.steps]
    W = (V + 31) // 32
    index = TokenIndex(lambda t: tok.decode_bytes([t]), V)  # the engine's forced-position splits
    print(f"cpus {os.cpu_count()}, {len(ids)} steps, vocab {V}")
    for threads in (None, 4):
        ex = llguidance.LLExecutor(threads)
        for B in (int(b) for b in ns.batch.split(",")):
            sets = [[template.deep_copy() for _ in range(B)] for _ in range(3)]  # one per way: no shared cache
            out = np.zeros((B, W), np.int32)
            par, ser, adv, eng = [], [], [], []
            wrapped = [GrammarMatcher(m, index) for m in sets[2]]
            for t in ids:
                t0 = time.perf_counter()
                ex.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(sets[0])], out.ctypes.data, W * 4, B)
                t1 = time.perf_counter()
                for i, m in enumerate(sets[1]):
                    m.unsafe_compute_mask_ptr(out[i].ctypes.data, W * 4)
                t2 = time.perf_counter()
                fill_bitmasks(wrapped, V)  # the engine's way
                t3 = time.perf_counter()
                for ms in sets:
                    for m in ms:
                        assert m.consume_token(t), m.get_error()
                t4 = time.perf_counter()
                par.append(t1 - t0), ser.append(t2 - t1), eng.append(t3 - t2), adv.append((t4 - t3) / 3)
            med = lambda v: f"{statistics.median(v) * 1e6:.0f}/{np.percentile(v, 99) * 1e6:.0f}"
            print(f"threads {threads or 'default'} B={B}: LLExecutor {med(par)} us, one thread {med(ser)} us, "
                  f"fill_bitmasks {med(eng)} us, consume {med(adv)} us (median/p99 per step)")


if __name__ == "__main__":
    main()
