"""CPU matmul candidates for packed GGUF weights, on the bundled model's linear shapes (ADR 0006).

For each shape (SmolLM2-135M: qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, and the
tied Q8_0 head 49152x576 at decode) and row count M, the best of ``--repeats`` timings (µs) of:

- ``dense``: today's ``F.linear`` on float32 weights (MKL);
- ``torch_int4``: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` with group 32 scales and zeros
  (Q4_0/Q4_1/Q4_K are exactly that form);
- ``torch_int8``: ``_weight_int8pack_mm`` (per-channel scales only: Q8_0's 32-blocks do not fit;
  its speed alone is the question);
- ``packed``: monobatch's kernel (``PackedWeight.matmul`` at M <= GEMV_ROWS) and ``dequant_gemm``
  (dequantize the rows to float32, then ``F.linear``: the path above GEMV_ROWS).

Usage: ``python scripts/bench_packed_cpu.py -t 2 --json OUT.jsonl`` (one JSON line per timing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from monobatch.quant.formats import repack
from monobatch.quant.packed import PackedWeight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}


def best_us(fn, repeats: int, budget_s: float) -> float:
    """Best wall time of ``fn()`` in µs over ``repeats`` runs (fewer when a run exceeds the budget)."""
    fn()
    best = float("inf")
    start = time.perf_counter()
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() - start > budget_s:
            break
    return best * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,128,512", help="comma list of M")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--candidates", default="dense,torch_int4,torch_int8,packed,dequant_gemm")
    ap.add_argument("--json", help="write one JSON line per timing here too")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cands = a.candidates.split(",")
    rng = np.random.default_rng(0)
    out = open(a.json, "w") if a.json else None
    for name, (n, k) in SHAPES.items():
        qtype = T.Q8_0 if name == "head" else T.Q4_1
        w32 = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
        data = quantize(w32, qtype)
        pw = PackedWeight.from_repacked([(repack(qtype, data, k), qtype.name)], k)
        dense = pw.dequantize()
        part = pw.parts[0]
        if qtype == T.Q4_1:  # torch's int4 form: (q - 8) * s + z with z = m + 8 s
            q = torch.from_numpy(np.concatenate([part.qs.numpy() & 15, part.qs.numpy() >> 4], -1).reshape(n, k // 32, 2, 16)
                                 .reshape(n, k).astype(np.int32))
            w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            sz = torch.stack([part.scale.T, (part.minimum + 8 * part.scale).T], -1).contiguous()
        w8, s8 = torch.randint(-127, 127, (n, k), dtype=torch.int8), torch.rand(n)
        for m in (int(r) for r in a.rows.split(",")):
            if name == "head" and m > 1:
                continue
            x = torch.randn(m, k)
            fns = {"dense": lambda: F.linear(x, dense),
                   "torch_int8": lambda: torch.ops.aten._weight_int8pack_mm(x, w8, s8),
                   "packed": lambda: part.gemm(x),
                   "dequant_gemm": lambda: pw.dequant_gemm(x, part)}
            if qtype == T.Q4_1:
                fns["torch_int4"] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w4, 32, sz)
            for c in cands:
                if c not in fns or (c == "packed" and m > 16):
                    continue
                us = best_us(fns[c], a.repeats, budget_s=3.0)
                row = {"shape": name, "n": n, "k": k, "type": qtype.name, "m": m, "candidate": c,
                       "us": round(us, 1), "gflops": round(2 * m * n * k / us / 1e3, 2), "threads": a.threads}
                print(f"{name:8s} M={m:4d} {c:13s} {us:12.1f} us  {row['gflops']:7.2f} GFLOP/s", flush=True)
                if out:
                    out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
