"""Batch-invariant GEMM: ``y = x @ W^T (+ b)`` whose every output row has the same bits whatever
the number of rows M — the linear layer of ``--deterministic`` on CUDA.

cuBLAS picks its kernel, tile and split-K from M, so a row's sum over K is ordered differently in a
1-row decode GEMM and a 2,048-row prefill GEMM (He et al., "Defeating Nondeterminism in LLM
Inference", Thinking Machines 2025; SGLang's and vLLM's batch-invariant modes replace the GEMMs
for that reason). Here one Triton kernel computes every row with one reduction order, fixed by K
alone: K is cut into slices of :data:`SLICE_K` elements; each slice is walked in ascending
``tl.dot`` steps into a zeroed fp32 accumulator (``acc = dot(a, b, acc)``), and the slices' sums
are added in ascending slice order, starting from zero (``total = ((0 + s0) + s1) + ...``). Where
it pays (few rows: decode, a small batch, a short prompt), the slices run in separate programs
(split-K) whose partials the last program to finish adds in that same order (the GEMVs' epilogue,
:func:`monobatch.kernels.common.split_k_store`); else one program loops over them. Both give a
row the same bits, so the split is free to follow M — unlike cuBLAS's split-K, whose slice count
(and so the sum's order) follows M. The M and N tiles are free to follow M for speed *if* the MMA instructions they lower to
give a row the same bits (mma.sync for small tiles, wgmma from 64 rows on Hopper):
:data:`TILES` lists the tiles, and ``scripts/check_gemm_invariance.py`` checks on the GPU that
every one of them gives every row the same bits as every other — :data:`TILES` keeps only tiles
that passed there.

Inputs bf16/fp16 (fp32 accumulation); float32 inputs use IEEE products.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch

from monobatch import env
from monobatch.kernels.common import sm_count, tl, triton

if triton is not None:
    from monobatch.kernels.common import counters, grouped_tile, split_k_store
    from monobatch.kernels.fused import silu_mul_math

#: Every tile :func:`config_for` picks, ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)``. A
#: tile may join only with scripts/check_gemm_invariance.py passing on the target GPU (the module
#: docstring says why; on the H200 every tile it lists gave every row the same bits but a
#: one-step slice, BLOCK_K = SLICE_K, which :func:`linear` refuses).
TILES: tuple[tuple[int, int, int, int, int], ...] = (
    (16, 32, 64, 4, 3),     # decode rows, narrow outputs (split over the K slices)
    (16, 32, 256, 4, 3),    # decode rows, wide outputs (gate/up, the LM head)
    (64, 64, 64, 4, 4),     # batched decode, short prompts
    (128, 128, 64, 8, 3),   # prompts (wgmma-sized)
)
#: Outputs at most this wide are "narrow" (:func:`config_for`).
NARROW_N = 4096
#: The K slice (elements) of every row's reduction (the module docstring): a constant, so the
#: order of a row's sum depends on K alone, whatever M, the tile and the split. A multiple of
#: every BLOCK_K of :data:`TILES` (and of the check script's candidates), and larger.
SLICE_K = 512


#: Per thread: ``active`` is True inside :func:`mode` (True), where
#: :func:`monobatch.kernels.gemv.linear` and ``gated_linear`` route CUDA GEMMs here. The engine
#: sets it per forward in deterministic mode (as the batch-invariant modes of SGLang and vLLM swap
#: the matmul for the whole forward); per thread, so an engine in another thread (a server's
#: beside a test's) is never switched by it.
_STATE = threading.local()


def active() -> bool:
    """True inside :func:`mode` (True) on this thread."""
    return getattr(_STATE, "active", False)


@contextlib.contextmanager
def mode(on: bool):
    """Within the block (this thread), CUDA linear layers use this module's GEMM when ``on``;
    the previous state is restored after."""
    before = active()
    _STATE.active = bool(on) or before
    try:
        yield
    finally:
        _STATE.active = before


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when :func:`active` and the kernel can take these operands (CUDA, Triton, 2-D
    weight with unit stride along K, one dtype)."""
    return (active() and triton is not None and x.is_cuda and weight.dim() == 2 and weight.stride(1) == 1
            and x.dtype == weight.dtype and x.shape[-1] == weight.shape[1])


_MISSED: set[tuple] = set()


def warn_missed(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Log once per operand kind that a CUDA linear layer could not take this kernel inside
    :func:`mode` (True), so its rows are not batch-invariant (e.g. a dtype mismatch)."""
    key = (x.dtype, weight.dtype, weight.dim(), tuple(weight.stride()[1:]))
    if key not in _MISSED:
        _MISSED.add(key)
        logging.getLogger(__name__).warning(
            "deterministic mode: a linear layer (x %s, weight %s %s) runs on cuBLAS, not the batch-invariant GEMM; "
            "its rows may depend on the batch", x.dtype, weight.dtype, list(weight.shape))


def config_for(m: int, n: int) -> tuple[int, int, int, int, int]:
    """The tile (one of :data:`TILES`) for an ``[m, n]`` output. Chosen from
    scripts/check_gemm_invariance.py's timings on the H200 (2026-12-01, llama-1b's five weight
    shapes at M = 1, 64, 256, 2048; docs/benchmarks): up to 16 rows the 16-row tiles (64-weight K
    steps split over the slices for narrow outputs, 256-weight steps unsplit for wide ones); up to
    64 rows, and up to 512 for outputs at most twice :data:`NARROW_N` wide, 64 x 64; else 128 x 128."""
    if m <= 16:
        return TILES[1] if n > NARROW_N else TILES[0]
    if m <= 64 or (m <= 512 and n <= 2 * NARROW_N):
        return TILES[2]
    return TILES[3]


if triton is not None:

    @triton.jit
    def _k_step(acc, x_base, w_base, k, K, offs_k, mmask, nmask, IEEE: tl.constexpr):
        """One BLOCK_K step at K offset ``k``: ``acc`` ``[BM, BN]`` fp32 + x's tile times W's tile^T."""
        kmask = (k + offs_k) < K
        a = tl.load(x_base + k, mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_base + k, mask=nmask[:, None] & kmask[None, :], other=0.0)
        if IEEE:
            return tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        return tl.dot(a, tl.trans(b), acc)

    @triton.jit
    def _k_step_glu(acc, acc2, x_base, w_base, w2_base, k, K, offs_k, mmask, nmask, IEEE: tl.constexpr):
        """:func:`_k_step` for two weight tiles (gate's and up's rows) against one x tile: the same
        loads and ``tl.dot`` of each, so each accumulator has the bits :func:`_k_step`'s would."""
        kmask = (k + offs_k) < K
        a = tl.load(x_base + k, mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_base + k, mask=nmask[:, None] & kmask[None, :], other=0.0)
        b2 = tl.load(w2_base + k, mask=nmask[:, None] & kmask[None, :], other=0.0)
        if IEEE:
            return (tl.dot(a, tl.trans(b), acc, input_precision="ieee"),
                    tl.dot(a, tl.trans(b2), acc2, input_precision="ieee"))
        return tl.dot(a, tl.trans(b), acc), tl.dot(a, tl.trans(b2), acc2)

    @triton.jit
    def _gemm_kernel(X, W, B, Y, WS, CNT, M, N, K, stride_xm, stride_wn, stride_ym,
                     HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     SLICE: tl.constexpr, SPLIT: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr,
                     FLAT: tl.constexpr, GLU: tl.constexpr = False):
        # GLU (FLAT only, no bias): W is cat(gate, up) [2N, K]; the tile's gate and up sums, each
        # rounded to Y's dtype as the plain kernel stores them, go through silu_mul's formula (the
        # bits of fused.silu_mul of the plain product), and Y [M, N] gets silu(gate) * up
        tile = tl.program_id(0)
        pid_m, pid_n = grouped_tile(tile, M, N, BM, BN, GROUP_M)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        mmask = offs_m < M
        nmask = offs_n < N
        x_base = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_base = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        slices = tl.cdiv(K, SLICE)
        if SPLIT:  # one slice per program (program_id(1)); the epilogue adds them in slice order
            first = tl.program_id(1)
            last = first + 1
        else:
            first = 0
            last = slices
        total = tl.zeros([BM, BN], tl.float32)
        if GLU:  # FLAT's loop, for the gate and the up rows at once
            tl.static_assert(FLAT and not SPLIT and not HAS_BIAS, "GLU: one unsplit flat loop, no bias")
            PER_G: tl.constexpr = SLICE // BK
            w2_base = W + (offs_n[:, None] + N).to(tl.int64) * stride_wn + offs_k[None, :]  # the up rows
            acc = tl.zeros([BM, BN], tl.float32)
            acc2 = tl.zeros([BM, BN], tl.float32)
            total2 = tl.zeros([BM, BN], tl.float32)
            for i in range(0, slices * PER_G):
                acc, acc2 = _k_step_glu(acc, acc2, x_base, w_base, w2_base, i * BK, K, offs_k, mmask, nmask, IEEE)
                if i % PER_G == PER_G - 1:
                    total += acc
                    total2 += acc2
                    acc = tl.zeros([BM, BN], tl.float32)
                    acc2 = tl.zeros([BM, BN], tl.float32)
            out = silu_mul_math(total.to(Y.dtype.element_ty), total2.to(Y.dtype.element_ty))
            y_ptr = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
            tl.store(y_ptr, out, mask=mmask[:, None] & nmask[None, :])
        else:
            if FLAT:
                # The slices' K steps in one loop: one software pipeline over all of K (a nested loop
                # drains and refills it at every slice: H200, llama-1b, deterministic TTFT p256 3.97 ->
                # 3.31 ms). Each slice's sum still starts from zero and joins the total at its last step.
                PER: tl.constexpr = SLICE // BK
                acc = tl.zeros([BM, BN], tl.float32)
                for i in range(first * PER, last * PER):
                    acc = _k_step(acc, x_base, w_base, i * BK, K, offs_k, mmask, nmask, IEEE)
                    if i % PER == PER - 1:
                        total += acc
                        acc = tl.zeros([BM, BN], tl.float32)
            else:  # split-K's one slice (the decode tiles, as measured), or a flat=False call
                for s in range(first, last):  # ascending slices, each summed from zero: the order every row sees
                    acc = tl.zeros([BM, BN], tl.float32)
                    for kk in range(0, SLICE, BK):  # ascending K steps inside the slice
                        acc = _k_step(acc, x_base, w_base, s * SLICE + kk, K, offs_k, mmask, nmask, IEEE)
                    total += acc
            if SPLIT:
                split_k_store(tl.trans(total), WS, CNT, B, Y, M, N, tile, tl.program_id(1), slices, offs_m, offs_n,
                              mmask, nmask, stride_ym, HAS_BIAS)
            else:
                if HAS_BIAS:
                    total = total + tl.load(B + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
                y_ptr = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
                tl.store(y_ptr, total.to(Y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def split_for(m: int, n: int, k: int, config: tuple[int, int, int, int, int], device: torch.device) -> bool:
    """Whether the K slices run in separate programs (split-K) for an ``[m, n]`` output: where K
    has more than one slice and the output alone would leave the GPU short of programs — a
    narrow output of at most 16 rows (decode: each program streams a strip of the weight, so more
    programs keep more of it in flight) or fewer tiles than half the SMs. A speed choice only:
    both ways give a row the same bits (the module docstring); the H200 timings chose the rule."""
    if k <= SLICE_K:
        return False
    bm, bn = config[0], config[1]
    tiles = -(-m // bm) * -(-n // bn)
    return (m <= 16 and n <= NARROW_N) or 2 * tiles < sm_count(device)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, config: tuple[int, int, int, int, int] | None = None,
           split: bool | None = None, flat: bool = True) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with batch-invariant rows.

    Args:
        x: ``[M, K]`` (unit stride along K), on CUDA.
        weight: ``[N, K]`` (unit stride along K), x's dtype.
        bias: ``[N]`` or None.
        out_dtype: the output dtype (default x's; float32 for logits).
        config: force a tile (``scripts/check_gemm_invariance.py``); default :func:`config_for`.
        split: force split-K on or off (the check script, the tests); default :func:`split_for`.
            Never split where the fp32 workspace ``[slices, M, N]`` would pass 2**31 elements (the
            split epilogue's offsets are int32).
        flat: an unsplit tile's K steps in one loop (default) or nested per slice (a split
            tile's are nested); the same bits either way (the tests and the check script compare them).

    Returns:
        ``[M, N]`` in ``out_dtype``.

    Raises:
        RuntimeError: Triton is not installed.
        ValueError: ``config``'s BLOCK_K does not divide :data:`SLICE_K` or equals it (a one-step
            slice: Triton folds ``dot(a, b, 0) + total`` into ``dot(a, b, total)``, another order).
    """
    if triton is None:
        raise RuntimeError("Triton is not installed")
    M, K = x.shape
    N = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return y
    cfg = config or config_for(M, N)
    bm, bn, bk, warps, stages = cfg
    if SLICE_K % bk or bk == SLICE_K:
        raise ValueError(f"BLOCK_K {bk}: a divisor of SLICE_K ({SLICE_K}) below it (a one-step slice's "
                         "dot(a, b, 0) + total is fused by Triton into dot(a, b, total), another order)")
    slices = -(-K // SLICE_K)
    split = (split_for(M, N, K, cfg, x.device) if split is None else split) and 1 < slices and slices * M * N < 1 << 31
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    if split:
        ws = torch.empty(slices, M, N, dtype=torch.float32, device=x.device)
        cnt = counters(x.device, tiles)
    else:
        ws = cnt = y  # unused
    _gemm_kernel[(tiles, slices if split else 1)](
        x, weight, bias if bias is not None else weight, y, ws, cnt, M, N, K, x.stride(0), weight.stride(0),
        y.stride(0), HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk, SLICE=SLICE_K, SPLIT=split, GROUP_M=8,
        IEEE=x.dtype == torch.float32, FLAT=flat and not split, num_warps=warps, num_stages=stages)
    return y


#: :func:`glu_linear` for the deterministic mode's decode rows, on by default since 2026-12-05
#: (third session, H100): its bits equal the two launches' at the llama gate/up shapes
#: (test_glu_linear_cuda), check_batching --deterministic on llama-1b holds with it (alone =
#: batched = chunked = cache hit), and it moves the deterministic B=1 decode from 0.803x to 0.822x
#: of the default mode's at p256. ``MONOBATCH_DET_GLU=0`` (read at import) is the A/B switch: the
#: gate/up GEMM then fused.silu_mul, as before.
GLU = env.flag("MONOBATCH_DET_GLU", True)


def glu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """SwiGLU's gate for decode rows in one launch: ``silu(x @ gate^T) * (x @ up^T)`` for
    ``weight`` = cat(gate, up) ``[2F, K]``, with the bits of ``fused.silu_mul(linear(x, weight))``
    — the same tile, K order and roundings (each sum rounded to x's dtype, then silu_mul's formula,
    ``fused.silu_mul_math``), so a row's bits do not depend on which of the two ran (nor on M: the
    GEMM's invariance). Saves the silu_mul launch and the ``[M, 2F]`` round trip a layer of a
    deterministic decode step.

    Args:
        x: ``[M, K]`` on CUDA, weight's dtype.
        weight: ``[2F, K]``, unit stride along K.
        bias: must be None for the one launch.

    Returns:
        ``[M, F]`` in x's dtype, or None where it does not apply (not :func:`usable`, ``GLU`` off,
        more than 16 rows, a bias, or a product :func:`linear` would split: take the two-step
        path there).
    """
    if not GLU or bias is not None or not usable(x, weight) or x.dim() != 2 or weight.shape[0] % 2:
        return None
    M, K = x.shape
    cfg = config_for(M, weight.shape[0])
    if M > 16 or M == 0 or (K > SLICE_K and split_for(M, weight.shape[0], K, cfg, x.device)):
        return None
    return glu_launch(x, weight, cfg)


def glu_launch(x: torch.Tensor, weight: torch.Tensor, cfg: tuple[int, int, int, int, int]) -> torch.Tensor:
    """:func:`glu_linear`'s launch, unchecked (any device Triton runs on: its interpreter for the
    tests): x ``[M, K]``, weight ``[2F, K]``, ``cfg`` the tile :func:`linear` would take for the
    ``[M, 2F]`` product unsplit -> ``[M, F]`` in x's dtype."""
    M, K = x.shape
    N2 = weight.shape[0]
    bm, bn, bk, warps, stages = cfg
    F = N2 // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(M, F, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(M, bm) * triton.cdiv(F, bn)
    _gemm_kernel[(tiles, 1)](
        x, weight, weight, y, y, y, M, F, K, x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=False,
        BM=bm, BN=bn, BK=bk, SLICE=SLICE_K, SPLIT=False, GROUP_M=8, IEEE=x.dtype == torch.float32, FLAT=True,
        GLU=True, num_warps=warps, num_stages=stages)
    return y
