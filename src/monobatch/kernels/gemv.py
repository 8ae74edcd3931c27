"""Skinny GEMM for decode-time linear layers on CUDA (Triton): ``y = x W^T (+ b)`` for a few rows.

At decode time a linear layer multiplies M = 1..16 token rows by an N x K weight that is read
once: the time is the weight's bytes over HBM bandwidth (~4.8 TB/s on an H200) plus a launch's
latency. cuBLAS took ~3.8 us on a 2 MB weight and reached 40-75 % of the bandwidth on 8-64 MB
ones (scripts/profile_decode.py). Here a program streams a ``[BLOCK_N, BLOCK_K]`` tile of W along
K (coalesced: W is row-major ``[N, K]``), multiplies it with all M rows of x, accumulates in fp32:

* FMA path (M <= 4): one ``[BLOCK_N, BLOCK_K]`` fp32 register accumulator per row of x, reduced
  over K after the loop; the loop is software-pipelined (``tl.range(num_stages=)``).
* DOT path: tensor cores on ``W_tile @ x_tile^T`` (x padded to 16 rows; operands swapped so the
  long N side fills the MMA's M, the usual trick for skinny GEMMs).

Split-K is deterministic: each K slice stores its fp32 partial in a workspace ``[SPLIT_K, M, N]``
and bumps a per-N-tile counter; the program that completes the count sums the partials in slice
order (so the bits do not depend on which slice ended last), adds the bias, writes y and resets
the counter ("serial split-K" with a semaphore as in CUTLASS; cf. Osama et al. 2023, Stream-K).
One launch, no host sync, no data-dependent allocation: CUDA-graph capturable.

The config is a fixed function of (N, K, M bucket, dtype, whether kernels run with PDL):
:data:`PDL_CONFIGS` with PDL, :data:`CONFIGS` (measured by ``scripts/tune_gemv.py``), or
:func:`_heuristic`, never timed at run time, so every process on the same kind of GPU and
settings runs the same kernel and gets the same bits (``MONOBATCH_PDL=0`` or a pre-Hopper GPU
may pick other tiles, hence other bits). ``MONOBATCH_TRITON_GEMV=0`` turns the path off.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from monobatch import env
from monobatch.kernels import invariant_gemm, pdl
from monobatch.kernels.common import COUNTERS, counters, tl, triton
from monobatch.kernels.fused import enabled as fused_enabled, silu_mul

if triton is not None:
    from monobatch.kernels.common import split_k_store
    from monobatch.kernels.fused import silu_mul_math

_ON = env.flag("MONOBATCH_TRITON_GEMV", True)
#: Most rows (tokens) the kernel takes; more go to cuBLAS (compute-bound territory).
MAX_M = 16
#: SM count of an H100/H200: a constant, so the heuristic does not depend on the GPU found.
_SMS = 132

#: ``(N, K, M bucket, dtype name): (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, DOT)``, or
#: None where cuBLAS measured faster (:func:`linear` then calls it). M bucket: M rounded up to a
#: power of two. Printed by ``scripts/tune_gemv.py`` (bf16; float16 uses the bfloat16 rows),
#: which times each kernel alone, without PDL; :data:`PDL_CONFIGS` overrides rows where kernels
#: are launched with it.
CONFIGS: dict[tuple[int, int, int, str], tuple[int, int, int, int, int, bool] | None] = {
    (3072, 2048, 1, "bfloat16"): (4, 1024, 1, 4, 1, False),  # llama-1b qkv M=1: 5.3 us vs cuBLAS 6.1 us
    (3072, 2048, 2, "bfloat16"): (8, 512, 1, 4, 3, False),  # llama-1b qkv M=2: 5.7 us vs cuBLAS 6.4 us
    (3072, 2048, 4, "bfloat16"): None,  # llama-1b qkv M=4: 6.4 us vs cuBLAS 6.4 us
    (3072, 2048, 8, "bfloat16"): None,  # llama-1b qkv M=8: 6.4 us vs cuBLAS 6.4 us
    (3072, 2048, 16, "bfloat16"): None,  # llama-1b qkv M=16: 6.4 us vs cuBLAS 6.5 us
    (2048, 2048, 1, "bfloat16"): (4, 1024, 1, 8, 1, False),  # llama-1b o M=1: 4.3 us vs cuBLAS 6.0 us
    (2048, 2048, 2, "bfloat16"): (4, 1024, 1, 4, 1, False),  # llama-1b o M=2: 4.6 us vs cuBLAS 6.0 us
    (2048, 2048, 4, "bfloat16"): (8, 256, 1, 4, 3, False),  # llama-1b o M=4: 5.6 us vs cuBLAS 6.0 us
    (2048, 2048, 8, "bfloat16"): (64, 128, 4, 4, 4, True),  # llama-1b o M=8: 5.7 us vs cuBLAS 6.0 us
    (2048, 2048, 16, "bfloat16"): (64, 128, 4, 4, 4, True),  # llama-1b o M=16: 5.7 us vs cuBLAS 6.1 us
    (16384, 2048, 1, "bfloat16"): (8, 512, 1, 4, 3, False),  # llama-1b gate_up M=1: 17.8 us vs cuBLAS 18.2 us
    (16384, 2048, 2, "bfloat16"): (64, 128, 1, 4, 3, True),  # llama-1b gate_up M=2: 17.6 us vs cuBLAS 18.1 us
    (16384, 2048, 4, "bfloat16"): (64, 128, 1, 4, 3, True),  # llama-1b gate_up M=4: 17.8 us vs cuBLAS 18.2 us
    (16384, 2048, 8, "bfloat16"): (64, 128, 1, 4, 3, True),  # llama-1b gate_up M=8: 18.0 us vs cuBLAS 18.4 us
    (16384, 2048, 16, "bfloat16"): (64, 128, 1, 4, 3, True),  # llama-1b gate_up M=16: 18.1 us vs cuBLAS 18.6 us
    (2048, 8192, 1, "bfloat16"): (4, 1024, 1, 4, 3, False),  # llama-1b down M=1: 10.1 us vs cuBLAS 12.8 us
    (2048, 8192, 2, "bfloat16"): (4, 1024, 1, 4, 3, False),  # llama-1b down M=2: 10.9 us vs cuBLAS 12.8 us
    (2048, 8192, 4, "bfloat16"): (64, 256, 4, 4, 3, True),  # llama-1b down M=4: 11.4 us vs cuBLAS 12.7 us
    (2048, 8192, 8, "bfloat16"): (64, 256, 4, 4, 3, True),  # llama-1b down M=8: 11.5 us vs cuBLAS 12.8 us
    (2048, 8192, 16, "bfloat16"): (64, 256, 4, 4, 3, True),  # llama-1b down M=16: 11.7 us vs cuBLAS 13.0 us
    (49152, 2048, 1, "bfloat16"): (8, 512, 1, 4, 3, False),  # llama-1b lm_head M=1: 47.4 us vs cuBLAS 50.6 us
    (49152, 2048, 2, "bfloat16"): (64, 128, 1, 4, 3, True),  # llama-1b lm_head M=2: 48.0 us vs cuBLAS 51.1 us
    (49152, 2048, 4, "bfloat16"): (64, 128, 1, 4, 3, True),  # llama-1b lm_head M=4: 48.4 us vs cuBLAS 51.4 us
    (49152, 2048, 8, "bfloat16"): (64, 128, 1, 4, 3, True),  # llama-1b lm_head M=8: 48.8 us vs cuBLAS 51.6 us
    (49152, 2048, 16, "bfloat16"): (64, 128, 1, 4, 3, True),  # llama-1b lm_head M=16: 49.6 us vs cuBLAS 52.3 us
    (960, 576, 1, "bfloat16"): (4, 1024, 1, 8, 1, False),  # smollm2-135m qkv M=1: 2.4 us vs cuBLAS 4.0 us
    (960, 576, 2, "bfloat16"): (4, 1024, 1, 4, 1, False),  # smollm2-135m qkv M=2: 2.6 us vs cuBLAS 4.0 us
    (960, 576, 4, "bfloat16"): (4, 256, 1, 4, 3, False),  # smollm2-135m qkv M=4: 3.0 us vs cuBLAS 3.9 us
    (960, 576, 8, "bfloat16"): (64, 128, 1, 4, 4, True),  # smollm2-135m qkv M=8: 3.4 us vs cuBLAS 3.6 us
    (960, 576, 16, "bfloat16"): (64, 128, 1, 4, 4, True),  # smollm2-135m qkv M=16: 3.4 us vs cuBLAS 3.7 us
    (576, 576, 1, "bfloat16"): (4, 1024, 1, 8, 1, False),  # smollm2-135m o M=1: 2.3 us vs cuBLAS 3.6 us
    (576, 576, 2, "bfloat16"): (4, 1024, 1, 4, 1, False),  # smollm2-135m o M=2: 2.4 us vs cuBLAS 3.6 us
    (576, 576, 4, "bfloat16"): (4, 256, 1, 4, 3, False),  # smollm2-135m o M=4: 2.9 us vs cuBLAS 3.6 us
    (576, 576, 8, "bfloat16"): (64, 128, 1, 4, 4, True),  # smollm2-135m o M=8: 3.3 us vs cuBLAS 3.6 us
    (576, 576, 16, "bfloat16"): (64, 128, 1, 4, 4, True),  # smollm2-135m o M=16: 3.4 us vs cuBLAS 3.6 us
    (3072, 576, 1, "bfloat16"): (4, 1024, 1, 4, 1, False),  # smollm2-135m gate_up M=1: 3.3 us vs cuBLAS 4.1 us
    (3072, 576, 2, "bfloat16"): (64, 128, 1, 4, 4, True),  # smollm2-135m gate_up M=2: 3.7 us vs cuBLAS 4.1 us
    (3072, 576, 4, "bfloat16"): (64, 128, 1, 4, 4, True),  # smollm2-135m gate_up M=4: 3.7 us vs cuBLAS 4.1 us
    (3072, 576, 8, "bfloat16"): (64, 128, 1, 4, 4, True),  # smollm2-135m gate_up M=8: 3.7 us vs cuBLAS 4.1 us
    (3072, 576, 16, "bfloat16"): (64, 128, 1, 4, 4, True),  # smollm2-135m gate_up M=16: 3.8 us vs cuBLAS 4.1 us
    (576, 1536, 1, "bfloat16"): (4, 1024, 1, 4, 3, False),  # smollm2-135m down M=1: 2.8 us vs cuBLAS 5.1 us
    (576, 1536, 2, "bfloat16"): (4, 512, 1, 4, 3, False),  # smollm2-135m down M=2: 3.1 us vs cuBLAS 5.1 us
    (576, 1536, 4, "bfloat16"): (4, 512, 1, 4, 3, False),  # smollm2-135m down M=4: 3.6 us vs cuBLAS 5.2 us
    (576, 1536, 8, "bfloat16"): (32, 256, 6, 4, 4, True),  # smollm2-135m down M=8: 4.3 us vs cuBLAS 5.0 us
    (576, 1536, 16, "bfloat16"): (32, 256, 6, 4, 4, True),  # smollm2-135m down M=16: 4.4 us vs cuBLAS 5.1 us
    (49152, 576, 1, "bfloat16"): None,  # smollm2-135m lm_head M=1: 18.5 us vs cuBLAS 16.6 us
    (49152, 576, 2, "bfloat16"): None,  # smollm2-135m lm_head M=2: 17.2 us vs cuBLAS 16.7 us
    (49152, 576, 4, "bfloat16"): None,  # smollm2-135m lm_head M=4: 17.5 us vs cuBLAS 16.8 us
    (49152, 576, 8, "bfloat16"): None,  # smollm2-135m lm_head M=8: 17.6 us vs cuBLAS 16.9 us
    (49152, 576, 16, "bfloat16"): None,  # smollm2-135m lm_head M=16: 18.0 us vs cuBLAS 17.5 us
    (6144, 4096, 1, "bfloat16"): (8, 256, 1, 4, 3, False),  # llama-8b qkv M=1: 14.3 us vs cuBLAS 15.6 us
    (6144, 4096, 2, "bfloat16"): (64, 256, 1, 4, 4, True),  # llama-8b qkv M=2: 14.7 us vs cuBLAS 15.3 us
    (6144, 4096, 4, "bfloat16"): (64, 256, 1, 4, 4, True),  # llama-8b qkv M=4: 14.8 us vs cuBLAS 15.5 us
    (6144, 4096, 8, "bfloat16"): (64, 256, 1, 4, 4, True),  # llama-8b qkv M=8: 14.9 us vs cuBLAS 15.6 us
    (6144, 4096, 16, "bfloat16"): (64, 256, 1, 4, 4, True),  # llama-8b qkv M=16: 15.0 us vs cuBLAS 15.8 us
    (4096, 4096, 1, "bfloat16"): (8, 512, 1, 4, 3, False),  # llama-8b o M=1: 10.1 us vs cuBLAS 12.4 us
    (4096, 4096, 2, "bfloat16"): (8, 512, 1, 4, 3, False),  # llama-8b o M=2: 10.6 us vs cuBLAS 12.4 us
    (4096, 4096, 4, "bfloat16"): (64, 256, 1, 4, 4, True),  # llama-8b o M=4: 11.2 us vs cuBLAS 12.4 us
    (4096, 4096, 8, "bfloat16"): (64, 256, 1, 4, 4, True),  # llama-8b o M=8: 11.2 us vs cuBLAS 12.4 us
    (4096, 4096, 16, "bfloat16"): (64, 256, 1, 4, 4, True),  # llama-8b o M=16: 11.2 us vs cuBLAS 12.5 us
    (28672, 4096, 1, "bfloat16"): None,  # llama-8b gate_up M=1: 55.2 us vs cuBLAS 55.9 us
    (28672, 4096, 2, "bfloat16"): None,  # llama-8b gate_up M=2: 56.0 us vs cuBLAS 56.1 us
    (28672, 4096, 4, "bfloat16"): None,  # llama-8b gate_up M=4: 56.0 us vs cuBLAS 56.4 us
    (28672, 4096, 8, "bfloat16"): None,  # llama-8b gate_up M=8: 56.7 us vs cuBLAS 56.8 us
    (28672, 4096, 16, "bfloat16"): None,  # llama-8b gate_up M=16: 56.8 us vs cuBLAS 57.0 us
    (4096, 14336, 1, "bfloat16"): (4, 512, 1, 4, 3, False),  # llama-8b down M=1: 28.8 us vs cuBLAS 30.9 us
    (4096, 14336, 2, "bfloat16"): (8, 512, 1, 4, 3, False),  # llama-8b down M=2: 29.4 us vs cuBLAS 31.1 us
    (4096, 14336, 4, "bfloat16"): (64, 128, 4, 4, 4, True),  # llama-8b down M=4: 30.6 us vs cuBLAS 31.3 us
    (4096, 14336, 8, "bfloat16"): None,  # llama-8b down M=8: 30.9 us vs cuBLAS 31.5 us
    (4096, 14336, 16, "bfloat16"): None,  # llama-8b down M=16: 31.3 us vs cuBLAS 31.8 us
}

#: Rows that replace :data:`CONFIGS`' where kernels are launched with PDL (kernels/pdl.py). A
#: program then loads its first W tile before waiting for the previous kernel, so a tile holding
#: the whole row (BLOCK_K = K) streams all of its weights while that kernel runs. Chosen with
#: ``scripts/ab_graphs.py`` on llama-1b's whole decode graph (H200, 2026-11-29: 0.906 -> 0.870 ms
#: a step at 256 tokens, 1.009 -> 0.973 ms at 8K; whole-row or split-K tiles for down measured
#: 3-7 % slower, for lm_head no change); other shapes keep their rows.
PDL_CONFIGS: dict[tuple[int, int, int, str], tuple[int, int, int, int, int, bool] | None] = {
    (3072, 2048, 1, "bfloat16"): (4, 2048, 1, 8, 1, False),  # llama-1b qkv M=1: 0.992x the step
    (2048, 2048, 1, "bfloat16"): (4, 2048, 1, 8, 1, False),  # llama-1b o M=1: 0.982x
    (16384, 2048, 1, "bfloat16"): (4, 2048, 1, 8, 1, False),  # llama-1b gate_up M=1: 0.984x
}

_MM_OUT_DTYPE: bool | None = None  # torch.mm(out_dtype=) support (torch >= 2.8), found on first use


def _pow2(n: int) -> int:  # n rounded up to a power of two (the M bucket)
    return 1 << max(0, n - 1).bit_length()


def _heuristic(N: int, K: int, mb: int) -> tuple[int, int, int, int, int, bool]:
    """Untuned default: FMA up to 4 rows, else DOT; split K while the grid stays under two
    programs per SM and each slice keeps >= 2 K blocks."""
    dot = mb > 4
    block_n, block_k = (32, 256) if dot else (8 if mb <= 2 else 4, 512 if mb == 1 else 256)
    block_k = max(16, min(block_k, _pow2(K)))
    tiles, splits = -(-N // block_n), 1
    while splits < 8 and tiles * splits * 2 <= 2 * _SMS and K >= 4 * splits * block_k:
        splits *= 2
    return block_n, block_k, splits, 4, 3, dot


def choose(N: int, K: int, M: int, dtype: torch.dtype,
           with_pdl: bool = False) -> tuple[int, int, int, int, int, bool] | None:
    """The config for an ``[M, K] x [N, K]^T`` product: the table's row for (N, K, M bucket,
    dtype) (:data:`PDL_CONFIGS`' first when ``with_pdl``), else the heuristic's. None: cuBLAS is
    faster for this shape (measured)."""
    key = (N, K, _pow2(M), {torch.float16: "bfloat16"}.get(dtype, str(dtype).removeprefix("torch.")))
    if with_pdl and key in PDL_CONFIGS:
        return PDL_CONFIGS[key]
    return CONFIGS[key] if key in CONFIGS else _heuristic(N, K, key[2])


def slices(K: int, block_k: int, splits: int) -> tuple[int, int]:
    """``(k_per, splits)``: K cut into at most ``splits`` slices of whole ``block_k`` blocks
    (``k_per`` elements each, the last one shorter), none empty."""
    nk = -(-K // block_k)
    k_per = -(-nk // max(1, min(splits, nk))) * block_k
    return k_per, -(-K // k_per)


if triton is not None:

    @triton.jit
    def _load_x(ptrs, mask, K, GATED: tl.constexpr):
        # x, or with GATED SwiGLU's silu(gate) * up of packed [gate | up] rows (up at +K)
        if GATED:
            return silu_mul_math(tl.load(ptrs, mask=mask, other=0.0), tl.load(ptrs + K, mask=mask, other=0.0))
        else:
            return tl.load(ptrs, mask=mask, other=0.0)

    @triton.jit
    def _fma_row(acc, w, X, row, M, K, stride_xm, offs, kmask, GATED: tl.constexpr):
        xr = _load_x(X + row * stride_xm + offs, kmask & (offs * 0 + row < M), K, GATED).to(tl.float32)
        return acc + w * xr[None, :]

    @triton.jit
    def _gemv_step(acc, acc0, acc1, acc2, acc3, w, X, x_ptrs, k, offs_k, kmask, mmask, M, K, stride_xm,
                   M_PAD: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr, GATED: tl.constexpr):
        # one BLOCK_K slice of the product, its W tile ``w`` already loaded
        if DOT:
            xt = _load_x(x_ptrs + k, kmask[:, None] & mmask[None, :], K, GATED)
            if IEEE:  # float32 inputs: full-precision products (not TF32)
                acc = tl.dot(w, xt, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, xt, acc)
        else:
            w = w.to(tl.float32)
            acc0 = _fma_row(acc0, w, X, 0, M, K, stride_xm, k + offs_k, kmask, GATED)
            if M_PAD > 1:
                acc1 = _fma_row(acc1, w, X, 1, M, K, stride_xm, k + offs_k, kmask, GATED)
            if M_PAD > 2:
                acc2 = _fma_row(acc2, w, X, 2, M, K, stride_xm, k + offs_k, kmask, GATED)
                acc3 = _fma_row(acc3, w, X, 3, M, K, stride_xm, k + offs_k, kmask, GATED)
        return acc, acc0, acc1, acc2, acc3

    @triton.jit(do_not_specialize=["M", "splits"])
    def _gemv_kernel(X, W, B, Y, WS, CNT, M, N, K, k_per, splits, stride_xm, stride_wn, stride_ym,
                     HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr, GATED: tl.constexpr,
                     PDL: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, M_PAD)
        offs_k = tl.arange(0, BLOCK_K)
        nmask = offs_n < N
        mmask = offs_m < M
        k_lo = pid_k * k_per
        k_hi = tl.minimum(k_lo + k_per, K)
        w_ptrs = W + (offs_n.to(tl.int64) * stride_wn)[:, None] + offs_k[None, :]
        x_ptrs = X + offs_m[None, :] * stride_xm + offs_k[:, None]  # x^T tile [BLOCK_K, M_PAD] (DOT)
        acc = tl.zeros((BLOCK_N, M_PAD), tl.float32)
        acc0 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)  # FMA: one 2D accumulator per row of x
        acc1, acc2, acc3 = acc0, acc0, acc0  # (2D, in the layout W is loaded in: no shuffles in the loop)
        # The first W tile is loaded before the PDL wait (weights are written by no kernel), so its
        # DRAM latency overlaps the previous kernel's tail (kernels/pdl.py); x only after it.
        kmask = k_lo + offs_k < k_hi
        w = tl.load(w_ptrs + k_lo, mask=nmask[:, None] & kmask[None, :], other=0.0)
        pdl.wait_prior(PDL)
        acc, acc0, acc1, acc2, acc3 = _gemv_step(acc, acc0, acc1, acc2, acc3, w, X, x_ptrs, k_lo, offs_k, kmask,
                                                 mmask, M, K, stride_xm, M_PAD, DOT, IEEE, GATED)
        for k in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K, num_stages=STAGES):
            kmask = k + offs_k < k_hi
            w = tl.load(w_ptrs + k, mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc, acc0, acc1, acc2, acc3 = _gemv_step(acc, acc0, acc1, acc2, acc3, w, X, x_ptrs, k, offs_k, kmask,
                                                     mmask, M, K, stride_xm, M_PAD, DOT, IEEE, GATED)
        if not DOT:  # reduce over K once; column m of acc <- row m of x
            acc = tl.where(offs_m[None, :] == 0, tl.sum(acc0, 1)[:, None], acc)
            if M_PAD > 1:
                acc = tl.where(offs_m[None, :] == 1, tl.sum(acc1, 1)[:, None], acc)
            if M_PAD > 2:
                acc = tl.where(offs_m[None, :] == 2, tl.sum(acc2, 1)[:, None], acc)
                acc = tl.where(offs_m[None, :] == 3, tl.sum(acc3, 1)[:, None], acc)
        split_k_store(acc, WS, CNT, B, Y, M, N, pid_n, pid_k, splits, offs_m, offs_n, mmask, nmask, stride_ym, HAS_BIAS)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, config: tuple | None = None, gated: bool = False) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` by the Triton kernel, always (no fallback).

    Args:
        x: ``[M, K]`` bf16/fp16 (fp32 works too: IEEE products, used by the interpreter tests),
            1 <= M <= :data:`MAX_M` (M = 0 gives an empty result), K >= 1. With ``gated``:
            ``[M, 2K]`` packed ``[gate | up]`` rows, and the product's input is SwiGLU's
            ``silu(gate) * up`` (the bits of :func:`monobatch.kernels.fused.silu_mul`), computed
            as it is loaded (the down projection without its own SiLU launch).
        weight: ``[N, K]`` same dtype, unit stride along K (rows may be padded).
        bias: ``[N]`` or None; added in fp32.
        out_dtype: result dtype (None: x's); float32 skips the rounding (LM head logits).
        config: ``(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, DOT)``; None: :func:`choose`.

    Returns:
        ``[M, N]``, fp32 accumulation.

    Raises:
        RuntimeError: Triton is not installed. ValueError: x's width does not match the weight
        (2 x with ``gated``), M > MAX_M, a strided weight row, or an FMA config (DOT False) with
        M > 4.
    """
    if triton is None:
        raise RuntimeError("Triton is not installed")
    M, K = x.shape[0], weight.shape[1]
    N = weight.shape[0]
    if x.shape[1] != (2 if gated else 1) * K:
        raise ValueError(f"x has {x.shape[1]} columns; the weight takes {K}" + (" (gated: 2 x that)" if gated else ""))
    if M > MAX_M or weight.stride(1) != 1:
        raise ValueError(f"gemv takes M <= {MAX_M} rows and a weight with unit stride along K")
    y = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    config = config or choose(N, K, M, x.dtype, pdl.enabled(x.device)) or _heuristic(N, K, _pow2(M))
    block_n, block_k, splits, warps, stages, dot = config
    if not dot and M > 4:
        raise ValueError("FMA configs take M <= 4 rows")
    x = x if x.stride(1) == 1 else x.contiguous()
    k_per, splits = slices(K, block_k, splits)
    tiles = -(-N // block_n)
    ws = torch.empty((splits, M, N) if splits > 1 else (1,), dtype=torch.float32, device=x.device)
    cnt = counters(x.device, tiles) if splits > 1 else COUNTERS.get(x.device)
    cnt = ws.new_empty(1, dtype=torch.int32) if cnt is None else cnt  # unused without split-K
    _gemv_kernel[(tiles, splits)](
        x, weight, y if bias is None else bias.contiguous(), y, ws, cnt, M, N, K, k_per, splits,
        x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, M_PAD=16 if dot else _pow2(M),
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, DOT=bool(dot), IEEE=x.dtype == torch.float32,
        GATED=gated, num_warps=warps, num_stages=stages, **pdl.launch(x.device))
    return y


def usable(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """True when :func:`linear` (:func:`gated_linear` with ``gated``) may take the Triton path for
    ``x`` ``[..., K]`` (``[..., 2K]`` with ``gated``): switched on, Triton present, CUDA, bf16/fp16 with a weight of the same
    dtype, contiguous ``[N, K]`` weight, K a multiple of 8 (16-byte rows), 1 <= rows <=
    :data:`MAX_M`."""
    K = x.shape[-1] // (2 if gated else 1) if x.dim() else 0
    return (_ON and triton is not None and x.is_cuda and weight.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.is_contiguous() and weight.shape[1] == K
            and x.shape[-1] == (2 if gated else 1) * K
            and K > 0 and K % 8 == 0 and 1 <= x.numel() // x.shape[-1] <= MAX_M)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``[..., K]``, ``weight`` ``[N, K]``: ``[..., N]`` in
    ``out_dtype`` (None: x's dtype; float32: not rounded to 16 bits). The Triton kernel where
    :func:`usable` and the config table does not prefer cuBLAS, else ``F.linear`` (float32 out:
    ``torch.mm(out_dtype=)`` on CUDA, torch >= 2.8; otherwise the 16-bit result, converted)."""
    global _MM_OUT_DTYPE
    N, K = weight.shape
    if invariant_gemm.usable(x, weight):  # deterministic mode: rows independent of M
        return invariant_gemm.linear(x.reshape(-1, K), weight, bias, out_dtype).view(*x.shape[:-1], N)
    if invariant_gemm.active() and x.is_cuda:
        invariant_gemm.warn_missed(x, weight)
    if usable(x, weight) and out_dtype in (None, x.dtype, torch.float32):
        x2 = x.reshape(-1, K)
        cfg = choose(N, K, x2.shape[0], x.dtype, pdl.enabled(x.device))
        if cfg is not None:
            return gemv(x2, weight, bias, out_dtype, cfg).view(*x.shape[:-1], N)
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(x, weight, bias)
    if x.is_cuda and out_dtype == torch.float32 and _MM_OUT_DTYPE is not False:
        try:
            y = torch.mm(x.reshape(-1, K), weight.t(), out_dtype=out_dtype).view(*x.shape[:-1], N)
            _MM_OUT_DTYPE = True
            return y if bias is None else y + bias
        except (TypeError, RuntimeError):
            _MM_OUT_DTYPE = False
    return F.linear(x, weight, bias).to(out_dtype)


def gated_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's down projection ``F.linear(silu(gate) * up, weight, bias)`` (Shazeer 2020) for
    packed ``gate_up`` ``[..., 2K]`` and ``weight`` ``[N, K]``: ``[..., N]`` in gate_up's dtype. One
    Triton launch (the gate computed as the GEMV loads its input) where :func:`usable` and the
    table picks the Triton kernel; else :func:`monobatch.kernels.fused.silu_mul` (torch's
    ``silu(gate) * up`` where the fused kernels are off) then :func:`linear`. Either way the product's input has the bits of ``fused.silu_mul``'s output
    (one shared SiLU formula, ``fused.silu_mul_math``).

    Raises:
        ValueError: gate_up's width is not twice the weight's input width."""
    N, K = weight.shape
    if gate_up.shape[-1] != 2 * K:
        raise ValueError(f"gate_up has {gate_up.shape[-1]} columns; the weight takes {K} (gate_up: 2 x that)")
    if usable(gate_up, weight, gated=True) and not invariant_gemm.active():
        x2 = gate_up.reshape(-1, 2 * K)
        cfg = choose(N, K, x2.shape[0], gate_up.dtype, pdl.enabled(gate_up.device))
        if cfg is not None:
            return gemv(x2, weight, bias, None, cfg, gated=True).view(*gate_up.shape[:-1], N)
    if fused_enabled(gate_up):
        act = silu_mul(gate_up.reshape(-1, 2 * K)).view(*gate_up.shape[:-1], K)
    else:  # the torch reference (models.layers.GatedMLP's CPU path)
        gate, up = gate_up.split(K, dim=-1)
        act = F.silu(gate) * up
    return linear(act, weight, bias)
