"""The table of scripts/cpu_packed_bench.sh's results: per round, llama.cpp's llama-bench beside
monobatch bench (packed and dequantized weights), the ratios, and the peak RSS of ``generate``.

Usage: ``python scripts/cpu_packed_summary.py OUTDIR`` (prints Markdown).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def jsonl(path: Path) -> list[dict]:
    """The JSON objects of a file's lines (other lines skipped)."""
    rows = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def main(out: Path) -> int:
    print("| round | measure | llama.cpp tok/s | monobatch packed | ratio | monobatch dequant | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for lb in sorted(out.glob("llama_bench_r*.jsonl")):
        r = lb.stem.removeprefix("llama_bench_r")
        ll = {(x["n_prompt"], x["n_gen"]): x["avg_ts"] for x in jsonl(lb)}
        gen = next((g for p, g in ll if p == 0), 0)
        ours = {w: {x["prompt_tokens"]: x for x in jsonl(f)} if (f := out / f"monobatch_{w}_r{r}.jsonl").exists() else {}
                for w in ("packed", "dequant")}
        for name, ref, key, metric in (("prefill 128", ll.get((128, 0)), 128, "prefill_tok_s"),
                                       ("prefill 512", ll.get((512, 0)), 512, "prefill_tok_s"),
                                       (f"decode {gen} (prompt 128)", ll.get((0, gen)), 128, "decode_tok_s")):
            cells = []
            for w in ("packed", "dequant"):
                v = ours[w].get(key, {}).get(metric)
                cells += [f"{v:.1f}" if v else "-", f"{v / ref:.2f}x" if v and ref else "-"]
            print(f"| {r} | {name} | {ref:.1f} | " + " | ".join(cells) + " |" if ref else f"| {r} | {name} | - | ...")
    for w in ("packed", "dequant"):
        f = out / f"generate_{w}_maxrss_kb.txt"
        if f.exists():
            print(f"\npeak RSS of `generate` ({w}): {int(f.read_text().split()[-1]) / 1024:.0f} MiB")
        rows = [x for p in sorted(out.glob(f"monobatch_{w}_r*.jsonl")) for x in jsonl(p)]
        if rows:
            weights = (f"{rows[0]['weight_mib']} MiB" if "weight_mib" in rows[0]
                       else f"{rows[0]['weight_mb']} MB")  # rows written before bench reported MiB
            print(f"monobatch bench ({w}): weights {weights}; {rows[0]['engine']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
