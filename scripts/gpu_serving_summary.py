"""The targets table of issue 16 from the files ``scripts/gpu_serving.sh bench OUTDIR`` wrote.

    python3 scripts/gpu_serving_summary.py OUTDIR        # or --json for the rows as one JSON object

Reads ``llama_cpp.jsonl`` (llama-bench, llama-batched-bench), ``rounds.json`` (monobatch rounds:
arms b1_llama1b, b1_smollm2, batched, and the null arm), ``serve.json`` (bench-serve rounds: arms
llama_server, monobatch, null) and ``det.jsonl`` (``--deterministic`` runs); a missing file or
row shows as ``-``. Definitions, so each ratio says what it compares:

- llama.cpp numbers are medians of llama-bench's repetitions (``samples_ts`` / ``samples_ns``:
  its warm-up run is not among them) and of the two llama-batched-bench runs; llama.cpp's
  "TTFT p256" is the pp256 time (prefill of 256 tokens, no sampling, no HTTP); its decode is
  ``tg128`` at depth 256 / 8192 (a bare decode).
- monobatch numbers are the medians over rounds (``bench_rounds.py``); each round's value is
  itself the median of that run's ``-r`` timed runs. The null arm's ratio (b1_llama1b run again)
  is the noise floor of the same rounds.
- ratio = monobatch / llama.cpp (for ``--deterministic``: deterministic / default mode).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
    return rows


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


class LlamaCpp:
    """llama-bench and llama-batched-bench results of llama_cpp.jsonl."""

    def __init__(self, rows: list[dict]):
        self.bench = [r for r in rows if "n_prompt" in r and "samples_ts" in r]
        # the F16 shape's runs only (the packed step's runs on quantized files are tagged
        # "llama-batched-bench-<shape>:<type>")
        self.batched = [r for r in rows if "pl" in r and "speed_pp" in r and r.get("tool") == "llama-batched-bench"]

    def _bench(self, model: str, n_prompt: int, n_gen: int, n_depth: int) -> dict | None:
        for r in self.bench:
            if model in str(r.get("model_filename", "")) and (r["n_prompt"], r["n_gen"], r.get("n_depth", 0)) == (
                    n_prompt, n_gen, n_depth):
                return r
        return None

    def pp_tok_s(self, model: str, n: int) -> float | None:
        r = self._bench(model, n, 0, 0)
        return med(r["samples_ts"]) if r else None

    def pp_ms(self, model: str, n: int) -> float | None:
        r = self._bench(model, n, 0, 0)
        return med(r["samples_ns"]) / 1e6 if r and r.get("samples_ns") else None

    def tg_tok_s(self, model: str, depth: int) -> float | None:
        r = self._bench(model, 0, 128, depth)
        return med(r["samples_ts"]) if r else None

    def batched_metric(self, b: int, key: str) -> float | None:
        return med([r[key] for r in self.batched if r["pl"] == b and r.get("pp") == 128 and r.get("tg") == 128])


class Rounds:
    """Medians per (arm, label, metric) from a bench_rounds.py --json file."""

    def __init__(self, data: dict):
        self.stats = {(s["arm"], s["label"], s["metric"]): s for s in data.get("stats", [])}
        self.busy = data.get("busy")
        self.rounds = data.get("settings", {}).get("rounds")

    def get(self, arm: str, label: str, metric: str, key: str = "median") -> float | None:
        s = self.stats.get((arm, label, metric))
        return s.get(key) if s else None


def fmt(v: float | None, digits: int = 1) -> str:
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def verdict(r: float | None, target: str) -> str:
    if r is None:
        return "-"
    op, bound = target[:2], float(target[2:])
    ok = r >= bound if op == ">=" else r <= bound
    return "met" if ok else "NOT met"


def build_rows(out: Path) -> list[dict]:
    lc = LlamaCpp(read_jsonl(out / "llama_cpp.jsonl"))
    mb = Rounds(read_json(out / "rounds.json"))
    sv = Rounds(read_json(out / "serve.json"))
    det = {r.get("label"): r for r in read_jsonl(out / "det.jsonl") if "label" in r}
    rows: list[dict] = []

    def row(measure, ours, theirs, target, unit, note=""):
        r = ratio(ours, theirs)
        rows.append({"measure": measure, "llama_cpp": theirs, "monobatch": ours, "ratio": r, "target": target,
                     "verdict": verdict(r, target) if target else "", "unit": unit, "note": note})

    row("TTFT, 256-token prompt, llama-1b", mb.get("b1_llama1b", "engine p256 b1", "ttft_ms"),
        lc.pp_ms("llama-1b", 256), "<=1.0", "ms", "llama.cpp: pp256 time")
    row("TTFT, 8,192-token prompt, llama-1b", mb.get("b1_llama1b", "engine p8192 b1", "ttft_ms"),
        lc.pp_ms("llama-1b", 8192), "", "ms", "llama.cpp: pp8192 time")
    row("prefill, smollm2-135m, 256 tokens", mb.get("b1_smollm2", "engine p256 b1", "prefill_tok_s"),
        lc.pp_tok_s("smollm2", 256), ">=1.0", "tok/s")
    for b in (32, 64, 128, 256):
        row(f"batched prefill 128-token prompts, B={b}", mb.get("batched", f"engine p128 b{b}", "pp_tok_s"),
            lc.batched_metric(b, "speed_pp"), ">=1.2" if b <= 128 else "", "tok/s")
    for b in (32, 64, 128, 256):
        row(f"batched total 128+128, B={b}", mb.get("batched", f"engine p128 b{b}", "total_tok_s"),
            lc.batched_metric(b, "speed"), ">=1.5" if b >= 64 else "", "tok/s")
    for b in (32, 64, 128, 256):
        row(f"batched decode 128+128, B={b}", mb.get("batched", f"engine p128 b{b}", "tg_tok_s"),
            lc.batched_metric(b, "speed_tg"), "", "tok/s")
    row("serving: output tok/s (bench-serve)", sv.get("monobatch", "serve", "output_throughput"),
        sv.get("llama_server", "serve", "output_throughput"), ">=1.5", "tok/s")
    row("serving: TTFT p50", sv.get("monobatch", "serve", "median_ttft_ms"),
        sv.get("llama_server", "serve", "median_ttft_ms"), "<=1.0", "ms")
    row("serving: TTFT p99", sv.get("monobatch", "serve", "p99_ttft_ms"),
        sv.get("llama_server", "serve", "p99_ttft_ms"), "<=1.0", "ms")
    row("serving: TPOT p50", sv.get("monobatch", "serve", "median_tpot_ms"),
        sv.get("llama_server", "serve", "median_tpot_ms"), "", "ms")
    row("B=1 decode p256, llama-1b", mb.get("b1_llama1b", "engine p256 b1", "decode_tok_s"),
        lc.tg_tok_s("llama-1b", 256), "", "tok/s", "target: >= 1,138 tok/s (no regression)")
    row("B=1 decode p8192, llama-1b", mb.get("b1_llama1b", "engine p8192 b1", "decode_tok_s"),
        lc.tg_tok_s("llama-1b", 8192), "", "tok/s", "target: >= 987 tok/s (no regression)")
    row("B=1 decode p256, smollm2-135m", mb.get("b1_smollm2", "engine p256 b1", "decode_tok_s"),
        lc.tg_tok_s("smollm2", 256), "", "tok/s")

    def det_row(measure, label, metric, default, target):
        d = det.get(label, {}).get(metric)
        r = ratio(d, default)
        rows.append({"measure": measure, "llama_cpp": None, "monobatch": d, "default": default, "ratio": r,
                     "target": target, "verdict": verdict(r, target), "unit": "", "note": "ratio = deterministic / default"})

    det_row("--deterministic B=1 decode p256", "engine p256 b1", "decode_tok_s",
            mb.get("b1_llama1b", "engine p256 b1", "decode_tok_s"), ">=0.8")
    det_row("--deterministic TTFT p256", "engine p256 b1", "ttft_ms", mb.get("b1_llama1b", "engine p256 b1", "ttft_ms"), "<=1.3")
    det_row("--deterministic TTFT p8192", "engine p8192 b1", "ttft_ms",
            mb.get("b1_llama1b", "engine p8192 b1", "ttft_ms"), "<=1.3")
    det_row("--deterministic batched total B=64", "engine p128 b64", "total_tok_s",
            mb.get("batched", "engine p128 b64", "total_tok_s"), ">=0.75")
    for label, metric in (("engine p256 b1", "decode_tok_s"), ("engine p256 b1", "ttft_ms"), ("engine p8192 b1", "ttft_ms")):
        rows.append({"measure": f"null arm (noise floor): {label} {metric}", "llama_cpp": None,
                     "monobatch": mb.get("null", label, metric), "ratio": mb.get("null", label, metric, "ratio"),
                     "target": "", "verdict": "", "unit": "",
                     "note": f"spread {fmt(mb.get('null', label, metric, 'spread_pct'))} %; ratio = null / b1_llama1b"})
    rows.append({"measure": "null arm (noise floor): serving output tok/s", "llama_cpp": None,
                 "monobatch": sv.get("null", "serve", "output_throughput"),
                 "ratio": sv.get("null", "serve", "output_throughput", "ratio"), "target": "", "verdict": "", "unit": "",
                 "note": "ratio = null / llama_server"})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outdir", type=Path)
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    rows = build_rows(ns.outdir)
    if ns.json:
        print(json.dumps({"rows": rows}))
        return 0
    print(f"{'measure':<58} {'llama.cpp':>10} {'monobatch':>10} {'ratio':>7}  {'target':<7} {'verdict':<8} note")
    for r in rows:
        other = r["llama_cpp"] if "default" not in r else r["default"]
        print(f"{r['measure']:<58} {fmt(other):>10} {fmt(r['monobatch']):>10} {fmt(r['ratio'], 3):>7}  "
              f"{r['target']:<7} {r['verdict']:<8} {r['note']}")
    print("(--deterministic rows: the llama.cpp column holds the default mode's value)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
