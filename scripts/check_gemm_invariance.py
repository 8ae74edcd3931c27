"""Does a row of the batch-invariant GEMM (kernels/invariant_gemm.py) keep its bits across tile
configs and row counts on this GPU? And cuBLAS's (torch.mm)? Plus each config's time beside cuBLAS.

    PYTHONPATH=src python3 scripts/check_gemm_invariance.py [--shapes llama-1b,smollm2-135m] [--json OUT]
        [--tiles 128x128x64x8x3,128x128x128x8x4 --no-split]   # other candidates (BM x BN x BK x warps x stages)
        [--nested]   # also each tile's unsplit K steps nested per slice (':nested'; linear's default: one loop)

For every weight shape of the named model shapes: x ``[2048, K]`` bf16 random; each candidate tile
computes ``x[:M] @ W^T`` for M in (1, 3, 16, 17, 64, 100, 512); every row must equal the same row
of the first candidate at M = 512 (bitwise), each with split-K off and on (``:split``; unsplit: the
K steps in one loop, and with ``--nested`` also nested per slice, ``:nested``). Prints one
JSON object: per shape and candidate the rows that differ (0 = invariant), and the GPU time (us,
CUDA-graph replays: no launch overhead) at M = 1, 64, 256 and 2048 for each candidate, for the
default choice (``default``: config_for and split_for) and for torch.mm.
"""

from __future__ import annotations

import argparse
import json

import torch

from monobatch.kernels import invariant_gemm
from monobatch.models.shapes import SHAPES

#: Tiles timed (BLOCK_K below invariant_gemm.SLICE_K: a one-step slice, 16x16x512, gave other bits on
#: the H200, 2026-12-01, and linear() refuses it).
CANDIDATES = [
    (16, 32, 128, 4, 4), (16, 16, 128, 4, 4), (16, 16, 256, 4, 3), (16, 32, 256, 4, 3),
    (16, 16, 128, 2, 4), (16, 64, 64, 4, 4), (16, 32, 64, 4, 3), (32, 64, 64, 4, 4), (64, 64, 64, 4, 4),
    (64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 32, 4, 4),
]
ROWS = (1, 3, 16, 17, 64, 100, 512)
TIMED_ROWS = (1, 64, 256, 2048)


def weight_shapes(name: str) -> list[tuple[int, int]]:
    s = SHAPES[name]
    d, f, hd = s["hidden_size"], s["intermediate_size"], s["hidden_size"] // s["num_attention_heads"]
    qkv = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * hd
    return [(qkv, d), (d, s["num_attention_heads"] * hd), (2 * f, d), (d, f), (s["vocab_size"], d)]


def timed(fn, reps: int = 20) -> float:
    """GPU time of one call (us): ``reps`` calls captured in a CUDA graph, the median of 5 replays
    / reps (launch overhead excluded, as inside the decode graphs)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-1b,smollm2-135m")
    ap.add_argument("--json")
    ap.add_argument("--tiles", help="comma-separated BMxBNxBKxWARPSxSTAGES to check instead of CANDIDATES "
                    "(each against the first CANDIDATE's rows)")
    ap.add_argument("--no-split", action="store_true", help="only the unsplit schedule of each tile")
    ap.add_argument("--nested", action="store_true",
                    help="also each tile's unsplit K steps nested per slice (':nested'; linear's default is one loop)")
    ns = ap.parse_args()
    tiles = [tuple(int(v) for v in t.split("x")) for t in ns.tiles.split(",")] if ns.tiles else CANDIDATES
    splits = ((False, True),) if ns.no_split else ((False, True), (True, False))  # (split, flat)
    if ns.nested:
        splits += ((False, False),)
    torch.manual_seed(0)
    report: dict = {"gpu": torch.cuda.get_device_name(), "shapes": {}}
    for shape in ns.shapes.split(","):
        for n, k in weight_shapes(shape):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(2048, k, device="cuda", dtype=torch.bfloat16)
            out_dtype = torch.float32 if n == SHAPES[shape]["vocab_size"] else torch.bfloat16
            ref = invariant_gemm.linear(x[:512], w, out_dtype=out_dtype, config=CANDIDATES[0])
            entry = {"differing_rows": {}, "time_us": {}}
            for cfg, (split, flat) in [(c, s) for c in tiles for s in splits] + [(None, (None, True))]:
                label = ("default" if cfg is None else
                         "x".join(map(str, cfg)) + (":split" if split else "")
                         + (":nested" if not split and not flat else ""))
                try:
                    bad = 0
                    for m in ROWS:
                        y = invariant_gemm.linear(x[:m], w, out_dtype=out_dtype, config=cfg, split=split, flat=flat)
                        bad += int((y != ref[:m]).any(dim=1).sum())
                    entry["differing_rows"][label] = bad
                    entry["time_us"][label] = [round(timed(lambda m=m: invariant_gemm.linear(
                        x[:m], w, out_dtype=out_dtype, config=cfg, split=split, flat=flat)), 1)
                        for m in TIMED_ROWS]
                except Exception as exc:  # e.g. a tile over the GPU's shared memory: recorded, the others go on
                    entry.setdefault("failed", {})[label] = f"{type(exc).__name__}: {str(exc)[:200]}"
            mm_ref = torch.mm(x[:512], w.t())
            entry["differing_rows"]["torch.mm"] = sum(int((torch.mm(x[:m], w.t()) != mm_ref[:m]).any(dim=1).sum())
                                                      for m in ROWS)
            entry["time_us"]["torch.mm"] = [round(timed(lambda m=m: torch.mm(x[:m], w.t())), 1) for m in TIMED_ROWS]
            report["shapes"][f"{shape}:{n}x{k}"] = entry
    text = json.dumps(report, indent=1)
    print(text)
    if ns.json:
        with open(ns.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
