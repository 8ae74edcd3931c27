"""Turn a ``scripts/probe_quant_cuda.py`` run's ``"best"`` rows into the packed GEMV's tuned
table for the GPU it ran on (:func:`monobatch.kernels.quant_gemm.tuned_configs`).

A product enters the table only where the sweep's best config beat the rule's
(:func:`~monobatch.kernels.quant_gemm.gemv_config` without a table) by at least ``--min-gain``
(default 3 %); the others keep the rule. The probe's baseline is always the rule (``table=False``),
whatever table is installed. The best of ~30 timed configs is biased low against the rule's one
timing: an entry near the threshold is within that bias, so re-time close picks against the rule
(interleaved runs) before relying on them::

    PROBE_MS=1 PROBE_TYPES=Q4_0,Q4_K,Q6_K \\
        python3 scripts/probe_quant_cuda.py --only bench --shapes llama-1b,llama-8b \\
        --sweep-shapes llama-1b,llama-8b > probe.jsonl
    python3 scripts/packed_gemv_table.py probe.jsonl --device "NVIDIA H200" \\
        -o src/monobatch/kernels/configs/packed_gemv_NVIDIA_H200.json

The DP4A GEMV's rows (``probe_quant_cuda.py --variant dp4a``, M = 1) give ``"<layout> <N>x<K> dp4a"``
entries, which serve every M <= FMA_MAX_M (chosen at M = 1; with the probe's ``PROBE_MS=1,4``
among the configs at most 3 % slower than the rule at 4 rows: its ``dp4a_best``). The FMA and
DP4A entries share a GPU's file, so the table at ``-o`` is merged into by default: its entries of products this run did not time are kept, a product timed again takes this
run's result (a new best, or the rule: its old entry is dropped); a file tuned on another GPU
(its ``device``) is refused; ``--replace`` writes only this run's entries::

    PROBE_MS=1,4 PROBE_TYPES=Q4_K,Q6_K python3 scripts/probe_quant_cuda.py --variant dp4a --only bench \\
        --shapes llama-8b --sweep-shapes llama-8b > dp4a.jsonl
    python3 scripts/packed_gemv_table.py dp4a.jsonl --device "NVIDIA H100 80GB HBM3" \\
        -o src/monobatch/kernels/configs/packed_gemv_NVIDIA_H100_80GB_HBM3.json

Prints one line a product (the rule's and the best time) and writes the JSON file.
"""

from __future__ import annotations

import argparse
import json
import sys


def table(lines: list[str], min_gain: float) -> tuple[dict[str, list], list[str], set[str]]:
    """``(configs, report lines, every key timed)`` from the probe's output lines (other lines are
    skipped)."""
    configs, report, timed = {}, [], set()
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict) or not row.get("best") or not row.get("rule_us"):
            continue
        gain = row["rule_us"] / row["us"] - 1
        dp4a = row.get("variant") == "dp4a"
        if dp4a and row["M"] != 1:
            continue  # a DP4A entry serves every M: chosen at M = 1, decode's row count
        key = f"{row['layout']} {row['N']}x{row['K']} " + ("dp4a" if dp4a else f"M{row['M']}")
        keep = gain >= min_gain
        timed.add(key)
        report.append(f"{'TABLE' if keep else 'rule '} {key:32} {row['shape']:9} {row['layer']:8} "
                      f"rule {row['rule_us']:8.2f} us  best {row['us']:8.2f} us  ({gain:+.1%})  {row['cfg']}")
        if keep and (key not in configs or row["us"] < configs[key][1]):
            configs[key] = (row["cfg"], row["us"])
    return {k: cfg for k, (cfg, _) in sorted(configs.items())}, report, timed


def merge(old: dict[str, list], configs: dict[str, list], timed: set[str]) -> dict[str, list]:
    """``old``'s entries of the products this run did not time, and this run's ``configs``."""
    return dict(sorted({**{k: v for k, v in old.items() if k not in timed}, **configs}.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("probe", help="the probe's output (JSON lines)")
    ap.add_argument("--device", required=True, help="the GPU's name, as torch.cuda.get_device_name() gives it")
    ap.add_argument("--min-gain", type=float, default=0.03)
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--replace", action="store_true",
                    help="write only this run's entries (default: merge into the table at -o, if there is one)")
    ns = ap.parse_args()
    with open(ns.probe, encoding="utf-8") as f:
        configs, report, timed = table(f.read().splitlines(), ns.min_gain)
    print("\n".join(report))
    if not ns.replace:
        try:
            with open(ns.output, encoding="utf-8") as f:
                old = json.load(f)
        except FileNotFoundError:
            old = {"configs": {}}
        if old.get("device") not in (None, ns.device):
            ap.error(f"{ns.output} was tuned on {old['device']!r}, not {ns.device!r}: another -o, or --replace")
        configs = merge(old["configs"], configs, timed)
    doc = {"device": ns.device, "source": "scripts/probe_quant_cuda.py + scripts/packed_gemv_table.py",
           "min_gain": ns.min_gain, "configs": configs}
    with open(ns.output, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"{len(configs)} tuned products -> {ns.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
