"""Packed-weight CUDA kernels (kernels/quant_gemm.py) timed alone on the GPU, beside the dense bf16
product of the same shape (the ``--weights dequant`` path: kernels/gemv.py for decode rows, cuBLAS
above), one JSON object a line on stdout.

Each product is captured in a CUDA graph and replayed (``triton.testing.do_bench_cudagraph``), so
launch overhead is the graph's, as in the engine's decode graphs. ``gbps`` counts the weight bytes
read once (packed: qs + scale + min; dense: 2 B a weight) over the time.

Usage (repo root, a GPU; ~2 min with compiles)::

    python3 scripts/bench_packed_cuda.py [--shapes llama-1b,llama-8b] [--sweep] > packed_kernels.jsonl

``--sweep`` also times alternative GEMV configs at M = 1 (tuning data for gemv_config).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from monobatch.kernels import gemv, quant_gemm  # noqa: E402
from monobatch.quant.random_packed import random_weight  # noqa: E402

SHAPES = {
    "llama-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                 "lm_head": (49152, 2048)},
    "llama-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                 "lm_head": (128256, 4096)},
}
TYPES = (T.Q4_K, T.Q8_0, T.Q6_K)  # the three layouts: Q4/32, Q8/32, Q8/16
MS = (1, 4, 16, 64, 512, 2048)
#: DOT GEMV configs swept at M = 1 (the FMA variant's sweep: scripts/probe_quant_cuda.py).
SWEEP = [(32, 256, 1, 4, 3, True), (16, 512, 1, 4, 3, True), (16, 1024, 1, 8, 2, True), (32, 512, 2, 4, 3, True),
         (64, 256, 1, 4, 3, True), (16, 256, 4, 4, 3, True), (16, 256, 8, 4, 4, True), (32, 256, 4, 4, 4, True),
         (32, 256, 8, 4, 4, True), (64, 128, 4, 4, 4, True), (32, 512, 4, 8, 3, True), (64, 256, 2, 8, 3, True),
         (16, 512, 8, 4, 3, True), (128, 128, 2, 8, 4, True), (32, 128, 8, 4, 6, True)]
#: The layouts swept (``--sweep-types``): Q4/32 (Q4_K, Q4_0, Q4_1), Q8/32 (Q8_0, Q5_0, Q5_K), Q8/16 (Q6_K).
SWEEP_TYPES = ("Q4_K", "Q8_0")


def time_us(fn) -> float:
    """Median microseconds of a replayed CUDA graph of ``fn``."""
    return triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama-1b,llama-8b")
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sweep-types", default=",".join(SWEEP_TYPES), help="GGUF types whose layout --sweep times")
    ns = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    ms = [int(m) for m in ns.ms.split(",")]
    for shape in ns.shapes.split(","):
        for name, (N, K) in SHAPES[shape].items():
            dense = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
            swept = [T[t] for t in ns.sweep_types.split(",")] if ns.sweep else []
            types = list(TYPES) + [t for t in swept if t not in TYPES]  # a fixed order: the same random weights
            packed = {t: random_weight(t, N, K, dev, gen) for t in types}
            for M in ms:
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=gen)
                d_us = time_us(lambda: gemv.linear(x, dense) if M <= gemv.MAX_M else F.linear(x, dense))
                row = {"shape": shape, "layer": name, "N": N, "K": K, "M": M, "dense_us": round(d_us, 2),
                       "dense_gbps": round(2 * N * K / d_us / 1e3, 1)}
                for t, w in packed.items():
                    part = w.parts[0]
                    us = time_us(lambda: w.matmul(x))
                    row[f"{t.name}_us"] = round(us, 2)
                    row[f"{t.name}_gbps"] = round(part.nbytes / us / 1e3, 1)
                    if M <= quant_gemm.MAX_M:
                        row[f"{t.name}_cfg"] = quant_gemm.gemv_config(N, K, M, part.layout)
                print(json.dumps(row), flush=True)
                if ns.sweep and M == 1:
                    for t in swept:
                        part = packed[t].parts[0]
                        best = None
                        for cfg in SWEEP:
                            if not cfg[5] and M > 4:
                                continue
                            us = time_us(lambda: quant_gemm.gemv(x, part, config=cfg))
                            best = min(best or (us, cfg), (us, cfg))
                            print(json.dumps({"sweep": True, "shape": shape, "layer": name, "M": M, "type": t.name,
                                              "cfg": cfg, "us": round(us, 2)}), flush=True)
                        print(json.dumps({"sweep_best": True, "shape": shape, "layer": name, "M": M, "type": t.name,
                                          "cfg": best[1], "us": round(best[0], 2)}), flush=True)
            del dense, packed
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
