"""Grammar-engine comparison on the bundled vocabulary (ADR 0004): llguidance vs xgrammar.

Measures, per backend: tokenizer setup, schema compile time (a 20-property schema and the
20 acceptance schemas of tests/schemas.py, median of N fresh compiles), per-token mask time
while walking a valid JSON document at B=1 and B=64, and how many of the acceptance schemas
each one compiles.

    .venv/bin/python scripts/bench_grammar.py [--repeat 7] [--json out.json]

xgrammar is not a dependency of monobatch: install it into the venv to compare
(``pip install xgrammar``); a backend that is not installed is skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from schemas import SCHEMAS  # noqa: E402  (the acceptance schemas, with a valid instance each)

from monobatch.loader import bundled_model_path  # noqa: E402
from monobatch.loader.gguf_file import open_gguf  # noqa: E402
from monobatch.tokenizer import Tokenizer  # noqa: E402


def twenty_properties() -> dict:
    kinds = [{"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "boolean"},
             {"type": "number"}, {"enum": ["a", "b", "c"]}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(20)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def doc_tokens(tok, schema_instance) -> list[int]:
    return tok.encode(json.dumps(schema_instance), add_special_tokens=False)


def bench_llguidance(tok, repeat: int) -> dict:
    import llguidance
    import llguidance.torch as lt
    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok._backend.to_str(), n_vocab=tok.vocab_size, eos_token=sorted(tok.eog_ids))
    setup = (time.perf_counter() - t0) * 1000
    schema = twenty_properties()

    def compile_one(s=schema):
        g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        m = llguidance.LLMatcher(lltok, g)
        assert not m.is_error(), m.get_error()
        return m

    compile_ms = median_ms(compile_one, repeat)
    ok = 0
    for s, _inst in SCHEMAS:
        try:
            m = compile_one(s)
            ok += not m.is_error()
        except Exception:
            pass
    inst = {f"field_{i}": v for i, v in enumerate(["x", 1, True, 1.5, "a"] * 4)}
    ids = doc_tokens(tok, inst)
    out = {"setup_ms": setup, "compile_20prop_ms": compile_ms, "schemas_compiled": ok}
    for B in (1, 64):
        ms = [compile_one() for _ in range(B)]
        mask = lt.allocate_token_bitmask(B, lltok.vocab_size)
        ex = llguidance.LLExecutor()
        per = []
        for t in ids:
            t0 = time.perf_counter()
            if B == 1:
                lt.fill_next_token_bitmask(ms[0], mask, 0)
            else:
                lt.fill_next_token_bitmask_par(ex, [(m, i) for i, m in enumerate(ms)], mask)
            per.append((time.perf_counter() - t0) * 1e6)
            for m in ms:
                assert m.consume_token(t), m.get_error()
        out[f"mask_us_B{B}_median"] = statistics.median(per)
        out[f"mask_us_B{B}_p99"] = sorted(per)[int(len(per) * 0.99)]
    return out


def bench_xgrammar(tok, repeat: int) -> dict:
    import xgrammar as xgr
    t0 = time.perf_counter()
    vocab = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=tok.vocab_size,
                             stop_token_ids=sorted(tok.eog_ids))
    setup = (time.perf_counter() - t0) * 1000
    schema = twenty_properties()

    def compile_one(s=schema):
        c = xgr.GrammarCompiler(info, cache_enabled=False)  # a fresh compile each time
        return c.compile_json_schema(json.dumps(s), any_whitespace=False)

    compile_ms = median_ms(compile_one, repeat)
    ok = 0
    for s, _inst in SCHEMAS:
        try:
            compile_one(s)
            ok += 1
        except Exception:
            pass
    inst = {f"field_{i}": v for i, v in enumerate(["x", 1, True, 1.5, "a"] * 4)}
    ids = doc_tokens(tok, inst)
    compiled = compile_one()
    out = {"setup_ms": setup, "compile_20prop_ms": compile_ms, "schemas_compiled": ok}
    for B in (1, 64):
        ms = [xgr.GrammarMatcher(compiled) for _ in range(B)]
        mask = xgr.allocate_token_bitmask(B, info.vocab_size)
        per = []
        for t in ids:
            t0 = time.perf_counter()
            for i, m in enumerate(ms):
                m.fill_next_token_bitmask(mask, i)
            per.append((time.perf_counter() - t0) * 1e6)
            for m in ms:
                assert m.accept_token(t)
        out[f"mask_us_B{B}_median"] = statistics.median(per)
        out[f"mask_us_B{B}_p99"] = sorted(per)[int(len(per) * 0.99)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", help="write the results here")
    ns = ap.parse_args()
    torch.set_num_threads(1)
    tok = Tokenizer.from_gguf(open_gguf(bundled_model_path()))
    results = {}
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            results[name] = fn(tok, ns.repeat)
        except ImportError as exc:
            results[name] = {"skipped": str(exc)}
        print(name, json.dumps(results[name], indent=1))
    results["num_schemas"] = len(SCHEMAS)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
