"""Exploration probe: a dp4a (int8 dot product) packed GEMV at M = 1 against our FMA GEMV, on the GPU.

Why: at llama-8b shapes on the H200 our packed decode GEMV (kernels/quant_gemm.py, the FMA
variant: float32 FMAs on the dequantized nibbles, ~4.4 SASS instructions a weight at M = 1) is
slower than llama.cpp's MMVQ kernels, which quantize the activation row to int8 per 32 columns
(q8_1: ``d = amax / 127``, ``xi = x (127 / amax)`` rounded half away from zero, and the group's
sum of ``xi``) and take integer dot
products with ``dp4a`` (4 int8 products summed into an int32 in one instruction). This script
measures what a Triton dp4a GEMV would give before one is designed into the engine. Nothing under
src/ changes.

The kernel (``_dp4a_gemv_kernel``): ``y[N] = x[K] W^T`` at M = 1, W a packed Q4 part as the loader
holds it on CUDA (device_repack; Q4_0's compact NEG8 layout: a float16 scale per 32 columns, min
``-8 scale``; Q4_K: its float32 per-group scales and mins from ``quant_gemm.group_scales``, a probe's
shortcut). Word p of group g holds bytes 4p..4p+3, byte b's low nibble column 32g + b and its high
one 32g + 16 + b, so ``w & 0x0F0F0F0F`` is 4 unsigned bytes for columns 4p..4p+3 and
``(w >> 4) & 0x0F0F0F0F`` for 16 + 4p..; x's int8 bytes of those columns are one int32 word each
(x's int8 row viewed as words: word 8g + p and 8g + 4 + p). Eight ``dp4a.u32.s32`` a (row, group)
give ``sumi = sum q xi``; the group adds ``d_w d_x (sumi - 8 sum xi)`` (Q4_0) or
``s d_x sumi + m d_x sum xi`` (Q4_K) to a float32 accumulator. BLOCK_N rows a program, NG groups a
K step, optional split-K (quant_gemm's workspace and last-slice merge). The activation's
quantization is either a separate small kernel (``_quant_x_kernel``, timed with and without it) or
done inside the GEMV (``FUSED``: every program quantizes the K slice it reads).

Parts of a run (one JSON object a line):

(a) check (GPU, or the interpreter with ``--tiny``): every variant against float64
    ``x_q @ W_deq^T`` (x_q = d xi, the int8 round trip; W_deq gguf-py's dequantization), relative
    to max |ref|, bound :data:`REL_TOL`; the error against the unrounded x is printed too (the int8
    activation's own error, ~1e-2).
(b) bench (GPU): llama-1b and llama-8b's products (scripts/probe_quant_cuda.model_shapes; the down
    projection with a plain x), Q4_0 and Q4_K, each :data:`CONFIGS` entry timed in a replayed CUDA
    graph: ``dp4a_us`` (quantization kernel + GEMV, or the fused GEMV), ``dp4a_noquant_us`` (the
    GEMV alone on a quantized x; null for fused configs), beside ``fma_us`` (quant_gemm.gemv, its
    default config) and ``dense_us`` (torch.nn.functional.linear on the bf16 dequantized weight),
    and an ``"engine"`` line a product: the engine's own DP4A GEMV (``quant_gemm.gemv`` at
    ``dp4a_config``, what ``MONOBATCH_PACKED_GEMV=dp4a`` runs) and its error against the same
    reference (this probe's kernels use the engine's dp4a, q8_1 rounding and scale helpers),
    then a ``best`` line per product.
(c) ``--ptx``: compiles the kernel for sm_90 without a GPU (Triton's ptxas) and reports the dp4a
    count and the instructions of the K loop in PTX and SASS (nvdisasm), per (row, 32-group).

Usage (repo root)::

    PYTHONPATH=src python3 scripts/probe_dp4a_gemv.py > dp4a.txt        # GPU: check + bench
    TRITON_INTERPRET=1 PYTHONPATH=src python3 scripts/probe_dp4a_gemv.py --tiny   # no GPU
    MONOBATCH_TRITON=1 PYTHONPATH=src python3 scripts/probe_dp4a_gemv.py --ptx    # no GPU

``--shapes llama-8b`` and ``--types Q4_0`` narrow the bench; ``--configs 0,3`` picks sweep entries.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from monobatch.kernels import quant_gemm as Q  # noqa: E402
from monobatch.kernels.common import COUNTERS, counters, tl, triton  # noqa: E402

if triton is None:
    sys.exit("probe_dp4a_gemv: no Triton (set MONOBATCH_TRITON=1 without a GPU)")
from monobatch.kernels.common import split_k_store  # noqa: E402

#: |y - ref| / max |ref| allowed against the float64 product of the int8-rounded x (the kernel sums
#: exact integer dot products; only the per-group float scaling and the fp32 accumulation round).
REL_TOL = 1e-5
#: ``(BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages, FUSED)``; SPLIT 0: K split until ~528 programs
#: (4 a multiprocessor on the H200's 132, as quant_gemm.gemv_config), else that many slices.
CONFIGS = [
    (64, 512, 0, 4, 1, False),   # quant_gemm's FMA default at M = 1
    (64, 1024, 0, 4, 1, False),
    (128, 512, 0, 4, 1, False),
    (32, 1024, 0, 4, 1, False),
    (64, 512, 0, 4, 2, False),
    (128, 1024, 0, 8, 1, False),
    (64, 256, 1, 4, 3, False),   # no split-K, pipelined
    (64, 512, 0, 4, 1, True),    # the same tiles, x quantized inside the GEMV
    (128, 1024, 0, 8, 1, True),
]
TYPES = (T.Q4_0, T.Q4_K)


# --------------------------------------------------------------------------------------------- kernels

# dp4a, the exact int-to-float and the q8_1 rounding and scale: the engine's own (quant_gemm), so
# the probe's kernels round x and sum bytes as MONOBATCH_PACKED_GEMV=dp4a does
from monobatch.kernels.quant_gemm import _amax, _int_to_float as _to_float, _max_nan, _q8_1 as _q8, _q8_1_scale  # noqa: E402,E501
from monobatch.kernels.quant_gemm import _dp4a as _engine_dp4a, _gemv_tile  # noqa: E402


@triton.jit
def _dp4a(w, x, acc, ASM: tl.constexpr):
    # acc + sum_b w.byte[b] (unsigned: Q4 nibbles) * x.byte[b] (signed), int32
    return _engine_dp4a(w, x, acc, False, ASM)


@triton.jit
def _quant_groups(X, g, K):
    # groups g [NG] of bf16 row X -> (lo, hi) int32 words [NG, 4] (x's int8 bytes of columns
    # 32g + 4p .. 4p + 3 and 32g + 16 + 4p ..; byte b column 4p + b), dx float32 [NG], sx int32 [NG]
    p = tl.arange(0, 4)
    b = tl.arange(0, 4)
    col = g[:, None, None] * 32 + p[None, :, None] * 4 + b[None, None, :]  # [NG, 4, 4]
    gm = (g < K // 32)[:, None, None]
    xl = tl.load(X + col, mask=gm, other=0.0).to(tl.float32)
    xh = tl.load(X + col + 16, mask=gm, other=0.0).to(tl.float32)
    dx, inv = _q8_1_scale(_max_nan(_amax(xl), _amax(xh)))
    ql = _q8(xl, inv[:, None, None])
    qh = _q8(xh, inv[:, None, None])
    sx = tl.sum(tl.sum(ql, axis=2), axis=1) + tl.sum(tl.sum(qh, axis=2), axis=1)
    shift = (b * 8)[None, None, :]
    lo = tl.sum((ql & 0xFF) << shift, axis=2)  # disjoint bytes: the sum is their OR
    hi = tl.sum((qh & 0xFF) << shift, axis=2)
    return lo, hi, dx, sx


@triton.jit
def _quant_x_kernel(X, XW, DX, SX, K, NG: tl.constexpr):
    # x bf16 [K] -> XW int32 [K/4] (word 8g + p: the low nibbles' columns of word p, 8g + 4 + p the
    # high ones': x's int8 row in column order), DX float32 [K/32], SX int32 [K/32]; NG groups a program
    g = tl.program_id(0) * NG + tl.arange(0, NG)
    lo, hi, dx, sx = _quant_groups(X, g, K)
    gm = g < K // 32
    p = tl.arange(0, 4)
    tl.store(XW + g[:, None] * 8 + p[None, :], lo, mask=gm[:, None])
    tl.store(XW + g[:, None] * 8 + 4 + p[None, :], hi, mask=gm[:, None])
    tl.store(DX + g, dx, mask=gm)
    tl.store(SX + g, sx, mask=gm)


@triton.jit
def _dp4a_gemv_kernel(X, XW, DX, SX, QW, S, MN, Y, WS, CNT, N, K, NG_ROW, g_per, splits, stride_wn, stride_sn,
                      BLOCK_N: tl.constexpr, NG: tl.constexpr, STAGES: tl.constexpr, FUSED: tl.constexpr,
                      NEG8: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
    # y [N] (float32 or bf16 Y) = x W^T at M = 1. QW: the Q4 words [N, K/8] (4 a group); S: Q4_0's
    # float16 scales (NEG8) or float32 scales, MN float32 mins (Q4_K via group_scales), [N, K/32].
    # FUSED: x (bf16 X) quantized here, each step's groups; else XW/DX/SX from _quant_x_kernel.
    pid_n, pid_k, offs_n, offs_m, nmask, _, g_lo, g_hi, w_rows, s_rows, m_rows, _ = _gemv_tile(
        QW, S, MN, MN, 1, N, NG_ROW, g_per, stride_wn, stride_sn, 0, BLOCK_N, 1)  # the engine's tile prologue
    offs_g = tl.arange(0, NG)
    j = tl.arange(0, NG * 4)  # a step's words of a row: group j // 4, word j % 4
    acc = tl.zeros((BLOCK_N, NG), tl.float32)
    for g0 in tl.range(g_lo, g_hi, NG, num_stages=STAGES):
        g = g0 + offs_g
        if EVEN:
            w = tl.load(w_rows[:, None] + (g0 * 4 + j)[None, :])
            s = tl.load(s_rows[:, None] + g[None, :]).to(tl.float32)
            if not NEG8:
                m = tl.load(m_rows[:, None] + g[None, :])
        else:
            wm = nmask[:, None] & (g0 * 4 + j < g_hi * 4)[None, :]
            gm = nmask[:, None] & (g < g_hi)[None, :]
            w = tl.load(w_rows[:, None] + (g0 * 4 + j)[None, :], mask=wm, other=0)
            s = tl.load(s_rows[:, None] + g[None, :], mask=gm, other=0.0).to(tl.float32)
            if not NEG8:
                m = tl.load(m_rows[:, None] + g[None, :], mask=gm, other=0.0)
        if FUSED:
            lo, hi, dx, sx = _quant_groups(X, g, K)
            xlo = tl.reshape(lo, (NG * 4,))
            xhi = tl.reshape(hi, (NG * 4,))
        else:
            xj = (g0 + j // 4) * 8 + j % 4
            if EVEN:
                xlo = tl.load(XW + xj)
                xhi = tl.load(XW + xj + 4)
            else:
                xlo = tl.load(XW + xj, mask=g0 + j // 4 < g_hi, other=0)
                xhi = tl.load(XW + xj + 4, mask=g0 + j // 4 < g_hi, other=0)
            dx = tl.load(DX + g, mask=g < g_hi, other=0.0)
            sx = tl.load(SX + g, mask=g < g_hi, other=0)
        d = _dp4a(w & 0x0F0F0F0F, xlo[None, :], tl.zeros_like(w), ASM)
        d = _dp4a((w >> 4) & 0x0F0F0F0F, xhi[None, :], d, ASM)
        sumi = tl.sum(tl.reshape(d, (BLOCK_N, NG, 4)), axis=2)  # [BN, NG]: the groups' sum q xi
        if NEG8:
            acc += s * (dx[None, :] * _to_float(sumi - sx[None, :] * 8))
        else:
            acc += s * (dx[None, :] * _to_float(sumi)) + m * (dx * sx.to(tl.float32))[None, :]
    split_k_store(tl.sum(acc, axis=1)[:, None], WS, CNT, Y, Y, 1, N, pid_n, pid_k, splits, offs_m, offs_n,
                  offs_m < 1, nmask, 0, False)


# ------------------------------------------------------------------------------------------------- host

ASM = os.environ.get("TRITON_INTERPRET") != "1"


def quantize_x(x: torch.Tensor, out: tuple | None = None, ng: int = 16) -> tuple:
    """bf16 ``x`` [1, K] -> ``(xw int32 [K/4], dx float32 [K/32], sx int32 [K/32])`` (q8_1 per 32 columns)."""
    K = x.shape[-1]
    xw, dx, sx = out or (torch.empty(K // 4, dtype=torch.int32, device=x.device),
                         torch.empty(K // 32, dtype=torch.float32, device=x.device),
                         torch.empty(K // 32, dtype=torch.int32, device=x.device))
    _quant_x_kernel[(triton.cdiv(K // 32, ng),)](x, xw, dx, sx, K, NG=ng, num_warps=4)
    return xw, dx, sx


def weight_args(part) -> tuple:
    """``(qw, s, m, NEG8)``: the words and the scales the kernel reads (Q4_0: the float16 scales as
    held; else float32 scales and mins from quant_gemm.group_scales)."""
    qw = part.qs.view(torch.int32)
    if part.layout.mins == Q.NEG8:
        return qw, part.scale, part.scale, True
    s, m = Q.group_scales(part)
    return qw, s.contiguous(), m.contiguous(), False


def slices(N: int, K: int, block_n: int, block_k: int, split: int) -> tuple[int, int]:
    """``(g_per, splits)``: groups a K slice and the slices (split 0: until ~528 programs)."""
    steps = -(-K // block_k)
    split = split or max(1, min(steps, -(-528 // -(-N // block_n))))
    k_per, splits = Q._slices(K, block_k, split)
    return k_per // 32, splits


def dp4a_gemv(x: torch.Tensor, wargs: tuple, N: int, cfg: tuple, xq: tuple | None = None,
              y: torch.Tensor | None = None, ws: torch.Tensor | None = None) -> torch.Tensor:
    """``x [1, K] @ W^T`` -> ``y [1, N]`` (x's dtype unless ``y`` given) by the dp4a kernel; ``xq``
    a quantized x (:func:`quantize_x`), else made here (FUSED configs need none)."""
    block_n, block_k, split, warps, stages, fused = cfg
    K = x.shape[-1]
    qw, s, m, neg8 = wargs
    if not fused and xq is None:
        xq = quantize_x(x)
    xw, dx, sx = (x, x, x) if fused else xq
    g_per, splits = slices(N, K, block_n, block_k, split)
    tiles = -(-N // block_n)
    y = torch.empty((1, N), dtype=x.dtype, device=x.device) if y is None else y
    if ws is None:
        ws = torch.empty((splits, 1, N) if splits > 1 else (1,), dtype=torch.float32, device=x.device)
    cnt = counters(x.device, tiles) if splits > 1 else COUNTERS.get(x.device)
    cnt = ws.new_empty(1, dtype=torch.int32) if cnt is None else cnt
    even = N % block_n == 0 and K % block_k == 0  # (slices are whole steps: Q._slices)
    _dp4a_gemv_kernel[(tiles, splits)](
        x, xw, dx, sx, qw, s, m, y, ws, cnt, N, K, K // 32, g_per, splits, qw.stride(0), s.stride(0),
        BLOCK_N=block_n, NG=block_k // 32, STAGES=stages, FUSED=fused, NEG8=neg8, EVEN=even, ASM=ASM,
        num_warps=warps, num_stages=stages)
    return y


def random_blocks(qtype: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    """tests/test_quant_cuda.random_blocks: ``n`` rows of ``k`` weights of ``qtype`` as raw bytes
    (random bits, fp16 scale fields finite of either sign)."""
    from gguf.constants import GGML_QUANT_SIZES
    rng = np.random.default_rng(seed)
    bs, ts = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (n * k // bs, ts), dtype=np.uint8)
    for off in {T.Q4_0: [0], T.Q4_K: [0, 2]}[qtype]:
        b[:, off:off + 2] = (rng.standard_normal(b.shape[0]) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(n, -1)


def make_part(qtype: T, n: int, k: int, dev: torch.device, seed: int = 0, gguf_ref: bool = True):
    """A packed part as the loader holds it on ``dev`` (tests/test_quant_cuda._parts) and its float64
    dequantized weights: gguf-py's (``gguf_ref``) or quant_gemm.dequantize's (bitwise the same but
    Q4_0's signed zeros; on the GPU, for the large shapes)."""
    from monobatch.quant import device_repack
    from monobatch.quant.packed import PackedPart
    data = random_blocks(qtype, n, k, seed)
    rep = device_repack.repack(qtype, torch.from_numpy(data).to(dev), k)
    part = PackedPart(rep.layout, rep.qs, rep.scale, rep.minimum, rep.sup)
    if gguf_ref:
        from gguf.quants import dequantize
        ref = torch.from_numpy(dequantize(data, qtype).reshape(n, k)).double().to(dev)
    else:
        ref = Q.dequantize(part).double()
    return part, ref


def xq_float(xq: tuple) -> torch.Tensor:
    """``d * xi`` float64 [1, K] of a quantized x."""
    xw, dx, _ = xq
    xi = xw.view(torch.int8).double().reshape(-1, 32)
    return (xi * dx.double()[:, None]).reshape(1, -1)


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


def check(qtype: T, N: int, K: int, cfgs: list, dev: torch.device, seed: int, gguf_ref: bool = True) -> list[dict]:
    """Every config against float64 ``x_q W^T``; one row a config (and one for the quantizer)."""
    part, w = make_part(qtype, N, K, dev, seed, gguf_ref)
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(1, K, device=dev, generator=gen).to(torch.bfloat16)
    xq = quantize_x(x)
    xqf = xq_float(xq)
    xf = x.double()
    # the quantizer: |d xi - x| <= d / 2 (plus rounding of x / d), sum xi right
    dx = xq[1].double().repeat_interleave(32)[None, :]
    q_ok = bool(((xqf - xf).abs() <= dx * (0.5 + 1e-5)).all()) and \
        torch.equal(xq[0].view(torch.int8).reshape(-1, 32).sum(1).to(torch.int32), xq[2])
    ref, ref_x = xqf @ w.T, xf @ w.T
    rows = [{"type": "check_quant", "qtype": qtype.name, "N": N, "K": K, "ok": q_ok,
             "x_rel_err": round(rel(xqf, xf), 6)}]
    wargs = weight_args(part)
    for cfg in cfgs:
        row = {"type": "check", "qtype": qtype.name, "N": N, "K": K, "config": list(cfg)}
        try:
            y = dp4a_gemv(x, wargs, N, cfg, xq, y=torch.empty(1, N, dtype=torch.float32, device=dev))
            row["rel_err"] = rel(y, ref)
            row["rel_err_vs_unrounded_x"] = round(rel(y, ref_x), 6)
            row["ok"] = row["rel_err"] < REL_TOL and bool(torch.isfinite(y).all())
        except Exception as e:  # noqa: BLE001 - a probe: report and go on
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ bench

def time_us(fn) -> float:
    """Median microseconds of a replayed CUDA graph of ``fn`` (scripts/probe_quant_cuda.py's)."""
    return triton.testing.do_bench_cudagraph(fn, rep=20) * 1e3


def bench(shapes: list[str], types: list[T], cfgs: list, dev: torch.device, deadline: float) -> None:
    from probe_quant_cuda import model_shapes
    import torch.nn.functional as F
    best: dict[tuple, dict] = {}
    for shape in shapes:
        for layer, (N, K, _gated) in model_shapes(shape).items():
            for qtype in types:
                if time.monotonic() > deadline:
                    print(json.dumps({"type": "skipped", "shape": shape, "layer": layer, "qtype": qtype.name,
                                      "why": "time budget"}), flush=True)
                    continue
                part, w = make_part(qtype, N, K, dev, seed=N + K, gguf_ref=False)
                wargs = weight_args(part)
                gen = torch.Generator(device=dev).manual_seed(1)
                x = torch.randn(1, K, device=dev, generator=gen).to(torch.bfloat16)
                xq = quantize_x(x)
                ref = xq_float(xq) @ w.T
                dense = w.to(torch.bfloat16)
                del w
                fcfg = Q.gemv_config(N, K, 1, part.layout, "fma", device=x.device)  # (the FMA baseline: dp4a is the default)
                fma_us = round(time_us(lambda: Q.gemv(x, part, config=fcfg)), 2)
                dense_us = round(time_us(lambda: F.linear(x, dense)), 2)
                del dense
                base = {"shape": shape, "layer": layer, "N": N, "K": K, "qtype": qtype.name}
                # the engine's own DP4A GEMV (MONOBATCH_PACKED_GEMV=dp4a: quant_gemm's kernel, its
                # dp4a_config, PDL, the quantization inside), beside this probe's configs
                ecfg = Q.dp4a_config(N, K, part.layout)
                erow = {"type": "engine", **base, "config": list(ecfg), "fma_us": fma_us, "dense_us": dense_us}
                try:
                    ye = Q.gemv(x, part, config=ecfg, out_dtype=torch.float32)
                    erow["rel_err"] = float(f"{rel(ye, ref):.3e}")
                    erow["engine_dp4a_us"] = round(time_us(lambda: Q.gemv(x, part, config=ecfg)), 2)
                    erow["speedup_vs_fma"] = round(fma_us / erow["engine_dp4a_us"], 2)
                except Exception as e:  # noqa: BLE001 - a probe: report and go on
                    erow["error"] = f"{type(e).__name__}: {e}"[:300]
                print(json.dumps(erow), flush=True)
                for cfg in cfgs:
                    row = {"type": "bench", **base, "config": list(cfg)}
                    try:
                        g_per, splits = slices(N, K, cfg[0], cfg[1], cfg[2])
                        y = torch.empty(1, N, dtype=torch.bfloat16, device=dev)
                        ws = torch.empty((splits, 1, N) if splits > 1 else (1,), dtype=torch.float32, device=dev)
                        yf = dp4a_gemv(x, wargs, N, cfg, xq, y=torch.empty(1, N, dtype=torch.float32, device=dev))
                        row["rel_err"] = float(f"{rel(yf, ref):.3e}")
                        if cfg[5]:
                            row["dp4a_us"] = round(time_us(lambda: dp4a_gemv(x, wargs, N, cfg, y=y, ws=ws)), 2)
                            row["dp4a_noquant_us"] = None
                        else:
                            xq2 = tuple(t.clone() for t in xq)
                            row["dp4a_us"] = round(time_us(
                                lambda: dp4a_gemv(x, wargs, N, cfg, quantize_x(x, xq2), y=y, ws=ws)), 2)
                            row["dp4a_noquant_us"] = round(time_us(
                                lambda: dp4a_gemv(x, wargs, N, cfg, xq, y=y, ws=ws)), 2)
                        row["splits"] = splits
                    except Exception as e:  # noqa: BLE001 - a probe: report and go on
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                    row.update(fma_us=fma_us, dense_us=dense_us, fma_config=list(fcfg))
                    print(json.dumps(row), flush=True)
                    if "dp4a_us" in row:
                        key = (shape, layer, qtype.name)
                        if key not in best or row["dp4a_us"] < best[key]["dp4a_us"]:
                            best[key] = row
                if (b := best.pop((shape, layer, qtype.name), None)) is not None:
                    print(json.dumps({**b, "type": "best", "speedup_vs_fma": round(fma_us / b["dp4a_us"], 2)}),
                          flush=True)
                del part, wargs
                torch.cuda.empty_cache()


# -------------------------------------------------------------------------------------------------- PTX

def ptx_report(cfg: tuple = (64, 512, 0, 4, 1, False), neg8: bool = True) -> dict:
    """Compile the GEMV (ASM=True, EVEN) for sm_90 without a GPU and count the K loop's instructions."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    block_n, block_k, _, warps, stages, fused = cfg
    fn = _dp4a_gemv_kernel
    consts = dict(BLOCK_N=block_n, NG=block_k // 32, STAGES=stages, FUSED=fused, NEG8=neg8, EVEN=True, ASM=True)
    ptrs = {"X": "*bf16", "XW": "*i32", "DX": "*fp32", "SX": "*i32", "QW": "*i32", "S": "*fp16" if neg8 else "*fp32",
            "MN": "*fp16" if neg8 else "*fp32", "Y": "*bf16", "WS": "*fp32", "CNT": "*i32"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        else:
            sig[name] = ptrs.get(name, "i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptx = k.asm["ptx"]
    threads = warps * 32
    per = block_n * (block_k // 32) / threads  # (row, group) pairs a thread a step
    out = {"type": "ptx", "config": list(cfg), "NEG8": neg8, "dp4a_total": ptx.count("dp4a.u32.s32")}
    body = _loop_body(ptx.splitlines(), r"^\$L__BB\d+_\d+:", r"bra(\.uni)?\s+(\$L__BB\d+_\d+);")
    if body is not None:
        ins = [ln for ln in body if ln.strip().endswith(";") and not ln.strip().startswith((".", "//"))]
        out.update(ptx_loop_lines=len(ins), ptx_loop_dp4a=sum("dp4a" in ln for ln in ins),
                   ptx_per_row_group=round(len(ins) / per, 2), ptx_per_weight=round(len(ins) / per / 32, 3))
        out["ptx_loop_ops"] = _ops(ins)
    sass = _sass(k.asm.get("cubin"))
    if sass:
        sbody = _loop_body(sass, r"^\.L_x_\d+:", r"BRA\s+(`\()?(\.L_x_\d+)")
        if sbody is not None:
            sins = [ln for ln in sbody if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
            out.update(sass_loop_instructions=len(sins), sass_loop_idp4a=sum("IDP.4A" in ln for ln in sins),
                       sass_per_row_group=round(len(sins) / per, 2), sass_per_weight=round(len(sins) / per / 32, 3))
            out["sass_loop_ops"] = _ops([re.sub(r"^.*?\*/\s*", "", ln) for ln in sins])
    return out


def _loop_body(lines: list[str], label_re: str, branch_re: str) -> list[str] | None:
    """The lines of the longest backward branch's loop (the K loop): label .. branch."""
    labels = {}
    best = None
    for i, ln in enumerate(lines):
        s = ln.strip()
        if re.match(label_re, s):
            labels[s.split(":")[0]] = i
        m = re.search(branch_re, s)
        if m and m.group(2) in labels:
            start = labels[m.group(2)]
            if best is None or i - start > best[1] - best[0]:
                best = (start, i)
    return None if best is None else lines[best[0] + 1:best[1] + 1]


def _ops(ins: list[str]) -> dict:
    """Opcode -> count (the first token, predicates dropped)."""
    counts: dict[str, int] = {}
    for ln in ins:
        tok = re.sub(r"^@!?%?\w+\s+", "", ln.strip()).split()
        if tok:
            counts[tok[0].rstrip(";")] = counts.get(tok[0].rstrip(";"), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def _sass(cubin: bytes | None) -> list[str] | None:
    """nvdisasm's listing of a cubin (Triton's bundled nvdisasm), or None."""
    if not cubin:
        return None
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        r = subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True)
    return r.stdout.splitlines() if r.returncode == 0 else None


# ------------------------------------------------------------------------------------------------- main

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama-8b,llama-1b", help="llama-8b first: the budget cuts the last")
    p.add_argument("--types", default="Q4_0,Q4_K")
    p.add_argument("--configs", default="", help="indices into CONFIGS (comma list; default all)")
    p.add_argument("--tiny", action="store_true", help="the check on small shapes only (the interpreter)")
    p.add_argument("--ptx", action="store_true", help="compile for sm_90 and count the loop's instructions")
    p.add_argument("--budget", type=float, default=110.0, help="seconds; the bench skips products past it")
    ns = p.parse_args()
    t0 = time.monotonic()
    types = [T[t] for t in ns.types.split(",") if t]
    cfgs = [CONFIGS[int(i)] for i in ns.configs.split(",")] if ns.configs else CONFIGS
    if ns.ptx:
        for cfg in (CONFIGS[0], CONFIGS[5], CONFIGS[7]):
            for neg8 in (True, False):
                try:
                    print(json.dumps(ptx_report(cfg, neg8)), flush=True)
                except Exception as e:  # noqa: BLE001
                    print(json.dumps({"type": "ptx", "config": list(cfg), "NEG8": neg8,
                                      "error": f"{type(e).__name__}: {e}"[:500]}), flush=True)
        return 0
    interpreted = not ASM
    dev = torch.device("cpu" if interpreted else "cuda")
    print(f"# dp4a probe: device={dev}{' ' + torch.cuda.get_device_name(dev) if dev.type == 'cuda' else ''} "
          f"ASM={ASM} triton={triton.__version__}", flush=True)
    fails = 0
    if ns.tiny or interpreted:
        # N off the tiles, K of whole Q4_K blocks; tiny tiles (the interpreter is slow), split-K, fused
        small = [(16, 64, 0, 4, 1, False), (16, 128, 2, 4, 1, False), (32, 256, 1, 4, 1, False),
                 (16, 64, 3, 4, 1, True), (16, 128, 1, 4, 1, True)]
        shapes = [(40, 256), (24, 512)]
    else:
        small, shapes = cfgs, [(3072, 2048)]  # (the masked kernels: the interpreter's check)
    for qtype in types:
        for i, (N, K) in enumerate(shapes):
            for row in check(qtype, N, K, small, dev, seed=i):
                fails += not row.get("ok", False)
                print(json.dumps(row), flush=True)
    print(json.dumps({"type": "check_done", "fails": fails, "seconds": round(time.monotonic() - t0, 1)}), flush=True)
    if not (ns.tiny or interpreted):
        bench(ns.shapes.split(","), types, cfgs, dev, t0 + ns.budget)
        print(json.dumps({"type": "done", "seconds": round(time.monotonic() - t0, 1)}), flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
