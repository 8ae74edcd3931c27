"""Packed GGUF weights on CUDA (kernels/quant_gemm.py, quant/device_repack.py; ADR 0006).

Three kinds of test:

- plain CPU tests (no Triton): the torch repack (what the loader runs on the GPU) is bitwise
  formats.repack, and the torch dequantization is bitwise gguf-py's, for every packed type;
- Triton's CPU interpreter (``*_in_interpreter``; skipped without Triton and on a GPU, where the
  CUDA tests run instead): the GEMV (FMA and DOT paths, split-K) and the tiled GEMM for every type
  against a float64 reference of ``gguf.quants.dequantize``'s weights, with fp32 activations,
  within :data:`REL_TOL`; the FMA GEMV at every M it takes (1..8) on the three layouts, N and K
  off its tile and step, split-K on and off, bias, the gated input; rows bitwise equal across
  M = 1, 3, 17, 64, 200 in batch-invariant mode;
- CUDA (``*_cuda``; skipped without a GPU, run by ``scripts/gpu_packed.sh`` with ``-k cuda``): the
  same in bf16 within :data:`BF16_TOL`, the FMA GEMV at the shapes where the old FMA variant gave
  wrong rows on the H200 and at llama-1b's five (against a torch fp32 reference, :data:`FP32_TOL`
  for a float32 output), CUDA-graph replay, invariance, a PackedWeight of two types with bias and
  lookups, and a tiny Q4_0 GGUF loaded packed on CUDA against its dequant load.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from helpers import run_in_triton_interpreter
from monobatch.quant import device_repack
from monobatch.quant.formats import DEVICE_LAYOUTS, PACKED_TYPES, repack

#: fp32 activations (interpreter): |y - float64 reference| / max |reference|, as tests/test_quant.py's
#: bound for a float32 dot product (K * 2^-24 with K = 512, times 4); observed ~4e-7 at K = 256.
REL_TOL = 4 * 512 * 2.0**-24
#: bf16 activations on CUDA: the same ratio for a bf16 output (bf16's 2^-9 relative rounding of the
#: output and, on the DOT and GEMM paths, of the weights, as the dequant path's bf16 weights are).
BF16_TOL = 1e-2
#: The FMA GEMV on CUDA with a float32 output, against torch's fp32 product of the same bf16 x and
#: fp32 dequantized weights: both sum the same fp32 products (the FMA path rounds no weight), in
#: other orders; |difference| / max |reference| is ~K * 2^-24 at worst for these random weights and
#: in practice ~sqrt(K) * 2^-24 (1e-5 at K = 8192): 1e-4 leaves room and still catches a wrong
#: group or column (which is >= 1e-2).
FP32_TOL = 1e-4
TYPES = list(PACKED_TYPES)
#: One type a packed layout: Q4/32, Q8/32, Q8/16.
LAYOUT_TYPES = (T.Q4_0, T.Q8_0, T.Q6_K)
INVARIANT_MS = (1, 3, 17, 64, 200)


def random_blocks(qtype: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    """``n`` rows of ``k`` weights of ``qtype`` as raw bytes (tests/test_quant.py's generator: random
    bits, fp16 scale fields finite of either sign; not imported from there, whose import builds the
    CPU kernels, a minute on a fresh GPU machine)."""
    from gguf.constants import GGML_QUANT_SIZES
    rng = np.random.default_rng(seed)
    bs, ts = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (n * k // bs, ts), dtype=np.uint8)
    fields = {T.Q4_0: [0], T.Q8_0: [0], T.Q5_0: [0], T.Q4_1: [0, 2], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
    for off in fields[qtype]:
        b[:, off:off + 2] = (rng.standard_normal(b.shape[0]) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(n, -1)


def _parts(qtype: T, n: int, k: int, seed: int = 0, device: str = "cpu"):
    data = random_blocks(qtype, n, k, seed)
    rep = device_repack.repack(qtype, torch.from_numpy(data).to(device), k)
    ref = torch.from_numpy(dequantize(data, qtype).reshape(n, k)).double().to(device)
    return rep, ref


@contextlib.contextmanager
def gemv_variant(variant: str):
    """``quant_gemm.VARIANT`` (``MONOBATCH_PACKED_GEMV``: the GEMV the default configs pick) set to
    ``variant`` inside the block: the float-accuracy checks below take the FMA variant, whose
    error is float32's (the default DP4A variant rounds x to int8: check_dp4a_gemv's bounds)."""
    from monobatch.kernels import quant_gemm as Q
    saved, Q.VARIANT = Q.VARIANT, variant
    try:
        yield
    finally:
        Q.VARIANT = saved


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_device_repack_is_formats_repack(qtype):
    """The torch repack (the loader's on CUDA) gives formats.repack's bytes, and compact scales and
    mins that expand (quant_gemm.group_scales) to its float32 ones bit for bit, in the bytes
    resident_bytes(compact=True) counts."""
    from monobatch.kernels.quant_gemm import group_scales
    from monobatch.quant.formats import DEVICE_LAYOUTS, resident_bytes
    from monobatch.quant.packed import PackedPart
    n, k = 24, 512
    data = random_blocks(qtype, n, k, seed=5)
    want = repack(qtype, data, k)
    got = device_repack.repack(qtype, torch.from_numpy(data), k)
    assert got.layout == DEVICE_LAYOUTS[qtype] and got.layout.base == want.layout
    assert np.array_equal(got.qs.numpy().view(np.uint8), want.qs.view(np.uint8))
    scale, minimum = group_scales(got)
    assert np.array_equal(scale.numpy().view(np.uint32), want.scale.view(np.uint32))
    assert np.array_equal(minimum.numpy().view(np.uint32), want.minimum.view(np.uint32))
    part = PackedPart(got.layout, got.qs, got.scale, got.minimum, got.sup)
    assert part.nbytes == resident_bytes(qtype, n * k, compact=True) < resident_bytes(qtype, n * k)
    direct = part.direct()  # what .to("cpu") makes of a CUDA part: the CPU kernels' layout
    assert direct.layout == want.layout and direct.sup is None
    assert torch.equal(direct.scale, scale) and torch.equal(direct.minimum, minimum)


def test_compact_part_slices():
    """Tensor parallel's cuts of a compact part: row ranges and column cuts keep every weight's
    bits — a cut on its 256-column super-blocks stays compact, one inside a super-block (on a group)
    is sliced in the DIRECT layout, one off the groups is refused; the CPU kernels read a compact part."""
    from monobatch.distributed.sharding import packed_cols_ok, take_cols, take_rows
    from monobatch.kernels.quant_gemm import dequantize as torch_dequantize
    from monobatch.quant.packed import PackedPart, PackedWeight, packed_supported
    n, k = 8, 512
    data = random_blocks(T.Q4_K, n, k, seed=3)
    want = repack(T.Q4_K, data, k)
    got = device_repack.repack(T.Q4_K, torch.from_numpy(data), k)
    part = PackedPart(got.layout, got.qs, got.scale, got.minimum, got.sup)
    assert part.to(torch.device("cpu")) is part  # already there
    w = PackedWeight([part], k, ("Q4_K",))
    assert packed_cols_ok(w, 0, 128) and not packed_cols_ok(w, 0, 80)
    left, right = take_cols(w, 0, 256), take_cols(w, 256, 512)  # on super-blocks: stays compact
    assert left.parts[0].layout == right.parts[0].layout == part.layout
    assert torch.equal(torch.cat([torch_dequantize(left.parts[0]), torch_dequantize(right.parts[0])], 1),
                       torch_dequantize(part))
    left, right = take_cols(w, 0, 160), take_cols(w, 160, 512)  # inside one: sliced DIRECT
    assert left.parts[0].layout == right.parts[0].layout == part.layout.base
    assert torch.equal(torch.cat([torch_dequantize(left.parts[0]), torch_dequantize(right.parts[0])], 1),
                       torch_dequantize(part))
    x = torch.randn(3, k)  # the CPU kernels read a compact part through its DIRECT form
    assert torch.equal(w.matmul(x), w.parts[0].direct().gemm(x)) if packed_supported(torch.device("cpu")) else True
    rows = take_rows(w, [(6, 8), (0, 2)], copy_=True)
    assert torch.equal(torch_dequantize(rows.parts[0]), torch_dequantize(part)[[6, 7, 0, 1]])
    assert np.array_equal(torch_dequantize(part).numpy(), dequantize(data, T.Q4_K).reshape(n, k))
    assert want.layout == part.layout.base


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_torch_dequantize_is_gguf(qtype):
    """quant_gemm.dequantize (CUDA's lookups) equals gguf-py's dequantization (Q4_0's zero signs aside)."""
    from monobatch.kernels import quant_gemm
    n, k = 16, 512
    rep, ref = _parts(qtype, n, k, seed=6)
    got = quant_gemm.dequantize(rep)
    assert got.dtype == torch.float32 and torch.equal(got.double(), ref)
    ids = torch.tensor([3, 0, 3, 15])
    assert torch.equal(quant_gemm.dequantize(rep.select(ids),
                                             torch.bfloat16), ref[ids].float().bfloat16())


def check_kernels(device: str = "cpu") -> str:
    """Every type: GEMV (the default configs of ``MONOBATCH_PACKED_GEMV=fma``; FMA ones up to M =
    FMA_MAX_M, DOT ones above and, on CUDA, at any M; split-K) and GEMM (M 1, 20, 70; three tiles)
    against the float64 reference, bias, output into a column slice, float32 out; in fp32
    (interpreter: fewer M and configs, a few seconds) or bf16 (CUDA)."""
    with gemv_variant("fma"):
        return _check_kernels(device)


def _check_kernels(device: str) -> str:
    from monobatch.kernels import common, quant_gemm as Q
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    tol = REL_TOL if device == "cpu" else BF16_TOL
    g = torch.Generator().manual_seed(0)
    n, k = 40, 256
    for i, qtype in enumerate(TYPES):
        rep, w = _parts(qtype, n, k, seed=i, device=device)
        args = (rep,)
        bias = torch.randn(n, generator=g).to(device, dtype)
        for M in ((1, 5, 20) if device == "cpu" else (1, 2, 3, 5, 16, 20, 70)):  # (each new M_PAD/tile: a compile)
            x = torch.randn(M, k, generator=g).to(device, dtype)
            ref = x.double() @ w.T
            refb = ref + bias.double()
            outs = []
            if M <= Q.MAX_M:
                fma = M <= Q.FMA_MAX_M
                cfgs = [None, (4 if fma else 16, 64, 3, 4, 2, not fma), (32, 128, 1, 4, 1, True)]
                for cfg in cfgs[:2] if device == "cpu" else cfgs:
                    outs.append(Q.gemv(x, *args, bias, config=cfg))
            for cfg in (None, Q.INVARIANT_TILE) if device == "cpu" else (None, quant_gemm_tile(M), Q.INVARIANT_TILE):
                outs.append(Q.gemm(x, *args, bias, config=cfg))
            for y in outs:
                assert y.dtype == dtype and y.shape == (M, n)
                assert _rel(y, refb) <= tol, (qtype.name, M)
            wide = torch.zeros(M, n + 24, dtype=torch.float32, device=device)
            Q.matmul(x, *args, out=wide[:, 8:8 + n])
            assert _rel(wide[:, 8:8 + n], ref) <= tol and not wide[:, :8].any() and not wide[:, 8 + n:].any()
            assert Q.matmul(x, *args, out_dtype=torch.float32).dtype == torch.float32
        if device != "cpu" or qtype in (T.Q4_K, T.Q6_K):  # SwiGLU's gate inside the GEMV: silu_mul's bits
            from monobatch.kernels.fused import silu_mul
            for M in (1, 3, 5, 20):
                gu = (torch.randn(M, 2 * k, generator=g) * 3).to(device, dtype)
                fma = ((8, 64, 3, 4, 2, False),) if M <= Q.FMA_MAX_M else ()
                for cfg in (None, (16, 64, 3, 4, 2, True)) + fma if M <= Q.MAX_M else (None,):
                    if M > Q.MAX_M:
                        got, want = Q.matmul(gu, *args, bias, gated=True), Q.matmul(silu_mul(gu), *args, bias)
                    else:
                        got = Q.gemv(gu, *args, bias, config=cfg, gated=True)
                        want = Q.gemv(silu_mul(gu), *args, bias, config=cfg)
                    assert torch.equal(got, want), (qtype.name, M, cfg)
        ids = torch.tensor([7, 0, 39, 7], device=device)  # the embedding lookup: one launch, dequantize's bits
        want = Q.dequantize(rep.select(ids))
        assert torch.equal(Q.take(ids, *args), want) and torch.equal(want.double(), w[ids])
        low = torch.float16 if device == "cpu" else torch.bfloat16  # (the interpreter's bf16 rounding is not faithful)
        assert torch.equal(Q.take(ids, *args, low), want.to(low))
        assert Q.take(ids[:0], *args).shape == (0, k)
        with pytest.raises(ValueError):
            Q.gemv(torch.zeros(Q.MAX_M + 1, k, dtype=dtype, device=device), *args)
        with pytest.raises(ValueError):
            Q.gemm(torch.zeros(2, k + 32, dtype=dtype, device=device), *args)
    counts = common.COUNTERS.get(torch.device(device))
    assert counts is None or int(counts.abs().sum()) == 0  # split-K left its counters zeroed
    return "ok"


def quant_gemm_tile(M: int) -> tuple:
    """A GEMM tile other than the default for M (rows of 16 or 64, BK 128)."""
    return (64, 32, 128, 4, 2) if M <= 32 else (16, 64, 128, 4, 2)


def check_fma_gemv() -> str:
    """The FMA GEMV (interpreter, fp32 activations) on each layout at every M it takes, against the
    float64 reference: N = 40 (off every BLOCK_N), K off the step (Q4_0/Q8_0 K = 320 with
    256-weight steps, Q6_K K = 768 with 512-weight steps), split-K off and on (2 and 3 slices: a
    short last slice), bias; the gated input has the bits of the product of silu_mul's output;
    and N = 32, K = 512 at M = 2..FMA_MAX_M (whole tiles and steps: the unmasked loads)."""
    from monobatch.kernels import quant_gemm as Q
    from monobatch.kernels.fused import silu_mul
    g = torch.Generator().manual_seed(7)
    n = 40
    for i, qtype in enumerate(LAYOUT_TYPES):
        k = 768 if qtype == T.Q6_K else 320
        step = 512 if qtype == T.Q6_K else 256
        rep, w = _parts(qtype, n, k, seed=20 + i)
        args = (rep,)
        bias = torch.randn(n, generator=g)
        for M in range(1, Q.FMA_MAX_M + 1):
            x = torch.randn(M, k, generator=g)
            ref = x.double() @ w.T
            cfgs = [(16, step, 1, 4, 2, False), (32, 64, 2 if M % 2 else 3, 4, 3, False)]
            for variant in ("dp4a", "fma", "dot"):  # what MONOBATCH_PACKED_GEMV picks at this M
                with gemv_variant(variant):
                    kind = Q.gemv_config(n, k, M, rep.layout)[5]
                want = Q.DP4A if variant == "dp4a" else (variant == "dot" or M > Q.FMA_DEFAULT_M)
                assert kind == want and type(kind) is type(want), (variant, M, kind)
            for cfg in cfgs:
                assert _rel(Q.gemv(x, *args, config=cfg), ref) <= REL_TOL, (qtype.name, M, cfg)
            if M in (1, 3, Q.FMA_MAX_M):
                assert _rel(Q.gemv(x, *args, bias, config=cfgs[1]), ref + bias.double()) <= REL_TOL
                gu = torch.randn(M, 2 * k, generator=g) * 3
                for cfg in cfgs:
                    got = Q.gemv(gu, *args, bias, config=cfg, gated=True)
                    assert torch.equal(got, Q.gemv(silu_mul(gu), *args, bias, config=cfg)), (qtype.name, M, cfg)
        with pytest.raises(ValueError):
            Q.gemv(torch.zeros(Q.FMA_MAX_M + 1, k), *args, config=(16, 64, 1, 4, 2, False))
        # N a multiple of BLOCK_N and K of the step: the unmasked (EVEN) loads, split in 2 slices
        rep, w = _parts(qtype, 32, 512, seed=30 + i)
        for M in range(2, Q.FMA_MAX_M + 1):
            x = torch.randn(M, 512, generator=g)
            cfg = (16, 256 if rep.layout.q4 else 128, 2, 4, 2, False)
            got = Q.gemv(x, rep, config=cfg)
            assert _rel(got, x.double() @ w.T) <= REL_TOL, (qtype.name, M)
    return "ok"


def check_dequant_matmul(device: str = "cpu") -> str:
    """From DEQUANT_MIN_M rows (16-bit activations, outside batch-invariant mode) a packed product
    is the dequant path's: the weight dequantized by take launches into x's dtype, then
    monobatch.kernels.gemv.linear once, bit for bit — one part through quant_gemm.matmul, and a
    fused weight of two layouts (Q4_K rows over Q6_K rows) through PackedWeight.cuda_matmul, one
    product of the whole [N, K] — with bias, a float32 output, an output column slice and the
    gated input; float32 activations take the tiled GEMM. fp16 in the interpreter, bf16 on CUDA."""
    from monobatch.kernels import gemv as dense, quant_gemm as Q
    from monobatch.kernels.fused import silu_mul
    from monobatch.quant.packed import PackedWeight
    dt = torch.float16 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(11)
    n, k = 40, 256
    for i, qtype in enumerate(LAYOUT_TYPES):
        rep, _ = _parts(qtype, n, k, seed=40 + i, device=device)
        args = (rep,)
        w = Q.dequantize(*args).to(dt)
        bias = torch.randn(n, generator=g).to(device, dt)
        for M in (Q.DEQUANT_MIN_M, Q.DEQUANT_MIN_M + 13):
            x = torch.randn(M, k, generator=g).to(device, dt)
            assert torch.equal(Q.matmul(x, *args, bias), dense.linear(x, w, bias))
            assert torch.equal(Q.matmul(x, *args, out_dtype=torch.float32), dense.linear(x, w, None, torch.float32))
            wide = torch.zeros(M, n + 8, dtype=torch.float32, device=device)
            Q.matmul(x, *args, out=wide[:, 4:4 + n])
            assert torch.equal(wide[:, 4:4 + n], dense.linear(x, w, None, torch.float32)) and not wide[:, :4].any()
            gu = torch.randn(M, 2 * k, generator=g).to(device, dt)
            assert torch.equal(Q.matmul(gu, *args, gated=True), dense.linear(silu_mul(gu), w))
            x32 = x.float()  # float32 activations: the tiled GEMM (IEEE products), not the 16-bit weights
            assert torch.equal(Q.matmul(x32, *args), Q.gemm(x32, *args))
    a, b = random_blocks(T.Q4_K, 64, k, 1), random_blocks(T.Q6_K, 32, k, 2)
    fused = PackedWeight.from_repacked([(repack(T.Q4_K, a, k), "Q4_K"), (repack(T.Q6_K, b, k), "Q6_K")], k).to(device)
    whole = np.concatenate([dequantize(a, T.Q4_K), dequantize(b, T.Q6_K)]).reshape(96, k)
    whole = torch.from_numpy(whole).to(device, dt)
    bias = torch.randn(96, generator=g).to(device, dt)
    x = torch.randn(Q.DEQUANT_MIN_M + 3, k, generator=g).to(device, dt)
    assert torch.equal(fused.cuda_matmul(x, bias), dense.linear(x, whole, bias))
    gu = torch.randn(Q.DEQUANT_MIN_M, 2 * k, generator=g).to(device, dt)
    assert torch.equal(fused.cuda_matmul(gu, gated=True, out_dtype=torch.float32),
                       dense.linear(silu_mul(gu), whole, None, torch.float32))
    return "ok"


#: How far the FMA GEMV's compiled outputs on a compact part and on its DIRECT twin may differ,
#: relative to the output's largest magnitude (and one bf16 ulp of a bf16 output): its group and
#: word sums are ``tl.sum`` trees whose order follows the layout the compiler picks, and the two
#: kernels get different layouts (sm_90 SASS of the 40x512 M=1 config, 2026-12-05: 6 warp shuffles
#: against 9, 14 barriers against 18), so their bits differ by float32 reordering (~1e-7); a
#: mis-decoded scale or min is >= ~1e-3. Making the trees explicit (split/reshape pairwise sums)
#: fixed the order but cost the Q4 kernel 62 % more SASS instructions and register spills
#: (measured by compilation, not adopted: docs/benchmarks/data/2026-12-05b-cpu/).
FMA_REORDER_TOL = 1e-5


def check_compact_is_direct(device: str = "cpu") -> str:
    """Every type's compact part (the loader's on CUDA) gives the bits of the same part with DIRECT
    float32 scales and mins (``PackedPart.direct``, what CUDA held before): the FMA and DOT GEMVs
    (split-K, bias, the gated input), the tiled GEMM (invariant tile too), ``take`` and the
    dequantizing product. On the GPU this checks what the interpreter cannot: that the compiled
    kernels round a factored scale and a missing min as the float32 layout's kernels do; the FMA
    GEMV's compiled outputs there within :data:`FMA_REORDER_TOL` (its sums' order follows the
    compiler's layout), every other kernel's bitwise."""
    from monobatch.kernels import invariant_gemm, quant_gemm as Q
    from monobatch.quant.packed import PackedPart
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(3)
    n, k = 40, 512
    for i, qtype in enumerate(TYPES):
        rep, _ = _parts(qtype, n, k, seed=50 + i, device=device)
        part = PackedPart(rep.layout, rep.qs, rep.scale, rep.minimum, rep.sup)
        direct = PackedPart(rep.layout.base, rep.qs, *Q.group_scales(part))  # float32, as part.direct() (Q4_1's float16: itself)
        assert direct.scale.dtype == torch.float32 and (part.direct().layout == direct.layout)
        bias = torch.randn(n, generator=g).to(device, dtype)
        for M in (1, 2, 3, 20):
            x = torch.randn(M, k, generator=g).to(device, dtype)
            gu = torch.randn(M, 2 * k, generator=g).to(device, dtype)
            # (call, how its two results compare: "exact"; "fma", the FMA GEMV, whose sums' order
            # may follow the compiled layout (within the tolerance on the GPU, bitwise in the
            # interpreter); "dp4a", the default GEMV (MONOBATCH_PACKED_GEMV=dp4a), whose NEG8 and
            # DIRECT formulas differ (s d (sumi - 8 sum xi) against s d sumi + m d sum xi): within
            # the tolerance everywhere)
            kind = {False: "fma", Q.DP4A: "dp4a"}.get(Q.gemv_config(n, k, M, part.layout, device=x.device)[-1], "exact")
            default = kind if M <= Q.MAX_M else "exact"
            calls = [(lambda w: Q.gemm(x, w, bias), "exact"),
                     (lambda w: Q.matmul(x, w, out_dtype=torch.float32), default)]
            if M <= Q.MAX_M:
                calls += [(lambda w: Q.gemv(x, w, bias), default),
                          (lambda w: Q.gemv(gu, w, config=(16, 128, 2, 4, 2, True), gated=True), "exact")]
            if M <= Q.FMA_MAX_M:
                calls += [(lambda w: Q.gemv(x, w, bias, config=(32, 256, 2, 4, 2, False), out_dtype=torch.float32), "fma"),
                          (lambda w: Q.gemv(gu, w, config=(16, 256, 1, 4, 1, False), gated=True), "fma")]
            for j, (call, how) in enumerate(calls):
                got, want = call(part), call(direct)
                if how == "dp4a" or (how == "fma" and device != "cpu"):  # a bf16 output: a reordering may cross a rounding boundary
                    ulp = 2.0 ** -7 if got.dtype is torch.bfloat16 else 0.0
                    assert torch.allclose(got.float(), want.float(), rtol=ulp,
                                          atol=FMA_REORDER_TOL * want.float().abs().max().item()), (qtype.name, M, j)
                else:
                    assert torch.equal(got, want), (qtype.name, M, j)
            with invariant_gemm.mode(True):
                assert torch.equal(Q.matmul(x, part), Q.matmul(x, direct)), (qtype.name, M)
        ids = torch.tensor([5, 0, 39, 5], device=device)
        assert torch.equal(Q.take(ids, part, dtype), Q.take(ids, direct, dtype))
        assert torch.equal(Q.dequantize(part), Q.dequantize(direct))
    return "ok"


def test_compact_is_direct_in_interpreter():
    run_in_triton_interpreter("test_quant_cuda", "check_compact_is_direct")


def test_compact_is_direct_cuda():
    _cuda()
    assert check_compact_is_direct("cuda") == "ok"


def test_dequant_matmul_cuda():
    _cuda()
    assert check_dequant_matmul("cuda") == "ok"


def test_dequant_matmul_in_interpreter():
    run_in_triton_interpreter("test_quant_cuda", "check_dequant_matmul")


def test_fma_gemv_in_interpreter():
    run_in_triton_interpreter("test_quant_cuda", "check_fma_gemv")


def check_invariance(device: str = "cpu") -> str:
    """Batch-invariant mode: every type's rows (packed matmul, any M) have the bits of the same
    rows at M = 200; on CUDA also of each row alone and at other places in the batch (the
    interpreter's numpy matmul gives a row other bits at another place in a tile; the GPU's MMA
    does not, as for the dense invariant GEMM)."""
    from monobatch.kernels import invariant_gemm, quant_gemm as Q
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(1)
    n, k = 48, 256
    types = TYPES if device != "cpu" else [T.Q4_K, T.Q6_K]  # the interpreter: the Q4 and the Q8 kernel paths
    for i, qtype in enumerate(types):
        rep, _ = _parts(qtype, n, k, seed=10 + i, device=device)
        args = (rep,)
        x = torch.randn(max(INVARIANT_MS), k, generator=g).to(device, dtype)
        with invariant_gemm.mode(True):
            full = Q.matmul(x, *args)
            for M in INVARIANT_MS:
                assert torch.equal(Q.matmul(x[:M], *args), full[:M]), (qtype.name, M)
                if device != "cpu":
                    assert torch.equal(Q.matmul(x[M - 1:M + 16], *args), full[M - 1:M + 16]), (qtype.name, M)
            for r in (0, 5, 17, 199) if device != "cpu" else ():
                assert torch.equal(Q.matmul(x[r:r + 1], *args), full[r:r + 1]), (qtype.name, r)
        assert torch.equal(full, Q.gemm(x, *args, config=Q.INVARIANT_TILE))
    return "ok"


#: How far the tiny model's logits on the DP4A GEMV may be from the dequantized model's, relative to
#: their largest magnitude: every product of a step rounds its x to int8 per 32 columns
#: (``|x - d xi| <= d / 2``, ~0.4 % of a group's max |x|), through the layers: 5.9e-3 and 8.5e-3
#: measured (the 40- and 6-token prompts, interpreter).
DP4A_MODEL_TOL = 2e-2


def check_model_forward() -> str:
    """A tiny Q4_0 llama GGUF (untied head, fused qkv of three row pieces, K = 64 and 96) loaded
    packed, its products routed through the CUDA dispatcher (PackedWeight.cuda_matmul: the Triton
    kernels, here interpreted on CPU tensors) and the layers' CUDA branches (fused kernels, the
    gated packed down projection): logits within float32 error of the dequant model's, for a
    40-token prefill (the GEMM) and 6-token steps (the GEMV), with the FMA GEMV; with the default
    DP4A GEMV (x rounded to int8 per 32 columns) the steps' logits within DP4A_MODEL_TOL."""
    import tempfile
    from pathlib import Path

    from test_models_tiny import make_hf, our_logits, write_gguf
    from monobatch.loader import gguf_file
    from monobatch.quant.packed import PackedWeight

    with tempfile.TemporaryDirectory() as tmp:
        write_gguf(make_hf("llama", Path(tmp) / "hf"), Path(tmp) / "m.gguf", T.Q4_0)
        cpu = torch.device("cpu")
        models = {w: gguf_file.load_gguf_model(gguf_file.open_gguf(Path(tmp) / "m.gguf"), cpu, torch.float32,
                                               progress=False, weights=w) for w in ("packed", "dequant")}
    assert models["packed"].lm_head.packed
    from monobatch.kernels import cpu_ops, fused
    PackedWeight.matmul = PackedWeight.cuda_matmul  # this subprocess only: the CUDA branches of the
    fused.enabled = lambda x: True  # layers too (fused norms, RoPE; SwiGLU's gate inside the packed GEMV)
    cpu_ops.available = lambda: False  # and no fused CPU route (its C++ calls the int16 GEMV directly)
    ids = list(range(3, 43))
    for variant, tol in (("fma", 1e-5), ("dp4a", DP4A_MODEL_TOL)):
        with gemv_variant(variant):
            for prompt in (ids, ids[:6]):
                got, want = our_logits(models["packed"], prompt), our_logits(models["dequant"], prompt)
                assert ((got - want).abs().max() / want.abs().max()).item() < tol, (variant, len(prompt))
    return "ok"


def test_model_forward_in_interpreter():
    run_in_triton_interpreter("test_quant_cuda", "check_model_forward")


def test_kernels_in_interpreter():
    run_in_triton_interpreter("test_quant_cuda", "check_kernels")


def test_invariance_in_interpreter():
    run_in_triton_interpreter("test_quant_cuda", "check_invariance")


def test_configs_are_valid():
    """The default configs are legal for the kernels at every decode M and model shape."""
    from monobatch.kernels import quant_gemm as Q
    from monobatch.quant.formats import Q4, Q8, Q8_16
    for N, K in ((3072, 2048), (2048, 8192), (16384, 2048), (49152, 576), (28672, 4096), (4096, 14336), (40, 64)):
        for layout in (Q4, Q8, Q8_16):
            for M, variant in ((M, v) for M in range(1, Q.MAX_M + 1) for v in ("dp4a", "fma", "dot")):
                with gemv_variant(variant):  # each setting of MONOBATCH_PACKED_GEMV
                    bn, bk, splits, warps, stages, dot = Q.gemv_config(N, K, M, layout)
                assert bk % 32 == 0 and bn & (bn - 1) == 0 and (bn >= 16 if dot else M <= Q.FMA_MAX_M) and splits >= 1
                bw = bk // (2 if layout.q4 else 1)
                assert bw & (bw - 1) == 0 and (dot or bw >= (16 if layout.q4 else layout.group))
                if variant == "dp4a" and M <= Q.FMA_MAX_M:
                    assert dot == Q.DP4A
                else:
                    assert dot == (M > Q.FMA_DEFAULT_M or variant == "dot")
                fma = Q.gemv_config(N, K, M, layout, "fma")
                assert (not fma[5]) == (M <= Q.FMA_MAX_M) and fma[2] >= 1 and fma[1] % 32 == 0
                k_per, s = Q._slices(K, bk, splits)
                assert k_per % bk == 0 and (s - 1) * k_per < K <= s * k_per
            for M in (1, 17, 64, 300, 4096):
                bm, bn, bk, _, _ = Q.gemm_config(M, N)
                assert bk % 64 == 0 and bm >= 16 and bn >= 16


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("CUDA only")
    from monobatch.kernels import common
    if common.triton is None:
        pytest.skip("Triton not installed")


def test_kernels_cuda():
    _cuda()
    assert check_kernels("cuda") == "ok"


def test_invariance_cuda():
    _cuda()
    assert check_invariance("cuda") == "ok"


@pytest.mark.parametrize("N,K", [(3072, 2048), (2048, 8192), (4096, 14336), (49152, 576)])
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_model_shapes_cuda(qtype, N, K):
    """Decode and prefill shapes of llama-1b/8b and the SmolLM2 head: every default config within
    BF16_TOL of the float64 reference; float32 logits output too."""
    _cuda()
    from gguf.constants import GGML_QUANT_SIZES
    if K % GGML_QUANT_SIZES[qtype][0]:
        pytest.skip(f"{qtype.name} rows are whole {GGML_QUANT_SIZES[qtype][0]}-weight blocks; K = {K}")
    from monobatch.kernels import quant_gemm as Q
    rep, w = _parts(qtype, N, K, seed=N % 97, device="cuda")
    args = (rep,)
    g = torch.Generator(device="cuda").manual_seed(3)
    for M in (1, 3, 16, 17, 256):
        x = torch.randn(M, K, generator=g, device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ w.T
        assert _rel(Q.matmul(x, *args), ref) < BF16_TOL, M
        if M in (1, 256):
            y32 = Q.matmul(x, *args, out_dtype=torch.float32)
            assert y32.dtype == torch.float32 and _rel(y32, ref) < BF16_TOL


#: (N, K, gated) of the CUDA FMA-GEMV test: where the old FMA variant gave wrong rows on the H200
#: (M = 1 at 64x512 for every type, 3072x2048 for the 8-bit layouts) and llama-1b's five products.
FMA_SHAPES = [(64, 512, False), (3072, 2048, False), (2048, 2048, False), (16384, 2048, False), (2048, 8192, True),
              (49152, 2048, False)]


@pytest.mark.parametrize("N,K,gated", FMA_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_fma_gemv_cuda(qtype, N, K, gated):
    """The FMA GEMV (its config, and the same without split-K) at M = 1..FMA_MAX_M: within
    FP32_TOL of torch's fp32 product (bf16 x, or silu_mul(gate, up) for the gated down projection,
    times the fp32 dequantized weights) with a float32 output, BF16_TOL with a bf16 one."""
    _cuda()
    from gguf.constants import GGML_QUANT_SIZES
    if K % GGML_QUANT_SIZES[qtype][0]:
        pytest.skip(f"{qtype.name} rows are whole {GGML_QUANT_SIZES[qtype][0]}-weight blocks; K = {K}")
    if N >= 16384 and qtype not in LAYOUT_TYPES + (T.Q4_K,):
        pytest.skip("the wide shapes: one type a layout (and Q4_K)")
    from monobatch.kernels import quant_gemm as Q
    from monobatch.kernels.fused import silu_mul
    rep, _ = _parts(qtype, N, K, seed=N % 89, device="cuda")
    args = (rep,)
    w = Q.dequantize(*args)
    g = torch.Generator(device="cuda").manual_seed(5)
    for M in range(1, Q.FMA_MAX_M + 1):
        x = torch.randn(M, 2 * K if gated else K, generator=g, device="cuda", dtype=torch.bfloat16)
        ref = (silu_mul(x) if gated else x).float() @ w.T
        cfg = Q.gemv_config(N, K, M, rep.layout, "fma")
        for c in (cfg, cfg[:2] + (1,) + cfg[3:]):
            y32 = Q.gemv(x, *args, config=c, gated=gated, out_dtype=torch.float32)
            assert _rel(y32, ref) < FP32_TOL, (M, c)
            assert _rel(Q.gemv(x, *args, config=c, gated=gated), ref) < BF16_TOL, (M, c)


@pytest.mark.parametrize("cfg", [(4, 512, 1, 4, 3, False), (8, 256, 4, 4, 2, False), (32, 256, 4, 4, 3, False),
                                 (32, 256, 3, 4, 3, True)])
def test_graph_replay_cuda(cfg):
    """A captured GEMV (split-K included) and GEMM replay with the eager bits, run after run."""
    _cuda()
    from monobatch.kernels import quant_gemm as Q
    rep, _ = _parts(T.Q4_K, 2048, 2048, device="cuda")
    args = (rep,)
    g = torch.Generator(device="cuda").manual_seed(4)
    for M in (1, 4, 16, 48):
        if M > Q.MAX_M or (not cfg[5] and M > Q.FMA_MAX_M):
            fn = lambda x: Q.gemm(x, *args)  # noqa: E731
        else:
            fn = lambda x: Q.gemv(x, *args, config=cfg)  # noqa: E731
        x = torch.randn(M, 2048, generator=g, device="cuda", dtype=torch.bfloat16)
        y = fn(x)
        assert all(torch.equal(y, fn(x)) for _ in range(3))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(x)
        for _ in range(3):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, y)


def test_packed_weight_cuda():
    """A PackedWeight of Q4_K rows over Q6_K rows moved to CUDA: matmul with bias at decode and
    prefill sizes (one output, each part its columns), embedding lookups (one part and two),
    dequantize; packed_supported is true there."""
    _cuda()
    from monobatch.quant.packed import PackedWeight, packed_supported
    assert packed_supported(torch.device("cuda"))
    k = 512
    a, b = random_blocks(T.Q4_K, 64, k, 1), random_blocks(T.Q6_K, 32, k, 2)
    w = PackedWeight.from_repacked([(repack(T.Q4_K, a, k), "Q4_K"), (repack(T.Q6_K, b, k), "Q6_K")], k).to("cuda")
    assert w.device.type == "cuda" and w.shape == (96, k)
    dense = torch.from_numpy(np.concatenate([dequantize(a, T.Q4_K), dequantize(b, T.Q6_K)]).reshape(96, k)).cuda()
    bias = torch.randn(96, device="cuda", dtype=torch.bfloat16)
    for M in (1, 5, 40):
        x = torch.randn(2, M, k, device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ dense.double().T + bias.double()
        y = w.matmul(x, bias)
        assert y.shape == (2, M, 96) and y.dtype == torch.bfloat16 and _rel(y, ref) < BF16_TOL
    ids = torch.tensor([3, 90, 3], device="cuda")
    assert torch.equal(w.embedding(ids, torch.float32), dense[ids])
    assert torch.equal(w.dequantize(), dense)
    single = PackedWeight.from_repacked([(repack(T.Q4_K, a, k), "Q4_K")], k).to("cuda")
    assert torch.equal(single.embedding(ids[[0, 2]], torch.bfloat16), dense[[3, 3]].bfloat16())


def _logits(model, ids: list[int], device: torch.device) -> torch.Tensor:
    from monobatch.batch import StepBatch
    from monobatch.kv.dense import DenseKv
    a = model.args
    kv = DenseKv(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, a.max_position_embeddings,
                 model.dtype, device, windows=a.layer_windows())
    rows, cut = [], len(ids) // 2
    for chunk, pos in ((ids[:cut], 0), (ids[cut:], cut)):
        batch = StepBatch.build([(0, chunk, pos, True)]).to(device)
        kv.prepare(batch)
        rows.append(model(batch, kv))
        kv.commit(batch)
    return torch.cat(rows).float()


def test_tiny_gguf_packed_on_cuda(tmp_path):
    """A tiny Q4_0 llama GGUF (untied head) loaded on CUDA: held packed there (resident bytes of
    the packed layout), and its logits, prefill chunks above 16 rows and short ones, within bf16
    error of the dequant load's."""
    _cuda()
    from test_models_tiny import make_hf, write_gguf
    from monobatch.loader import gguf_file
    from monobatch.quant.packed import packed_weights
    write_gguf(make_hf("llama", tmp_path / "hf"), tmp_path / "m.gguf", T.Q4_0)
    cuda = torch.device("cuda")
    models = {w: gguf_file.load_gguf_model(gguf_file.open_gguf(tmp_path / "m.gguf"), cuda, torch.bfloat16,
                                           progress=False, weights=w) for w in ("packed", "dequant")}
    held = packed_weights(models["packed"])
    assert held and all(w.device.type == "cuda" for w in held) and models["packed"].lm_head.packed
    assert not packed_weights(models["dequant"])
    ids = list(range(3, 3 + 40))
    for prompt in (ids, ids[:6]):
        got, want = _logits(models["packed"], prompt, cuda), _logits(models["dequant"], prompt, cuda)
        assert ((got - want).abs().max() / want.abs().max()).item() < 3e-2


def _sm90_quant_gemm(check_ptxas: bool = True):
    """quant_gemm for the sm_90 compile tests, or a skip: the interpreter compiles nothing, Triton
    absent, or (``check_ptxas``) this Triton unable to compile for sm_90 here."""
    import os
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter compiles nothing")
    from monobatch.kernels import quant_gemm as Q
    if Q.triton is None:
        pytest.skip("Triton not installed")
    from helpers import sm90_compile_problem
    if check_ptxas and sm90_compile_problem():
        pytest.skip(sm90_compile_problem())
    return Q


def _sm90(fn, constexprs: dict, signature: dict, **options) -> str:
    """PTX of a quant_gemm kernel compiled for sm_90 (Triton's bundled ptxas, no GPU needed)."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this Triton cannot compile ahead of time")
    sig = {name: ("constexpr" if name in constexprs else signature.get(name, "i32")) for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name not in constexprs and name not in ("M", "N", "K", "splits", "k_per", "N_A", "N_B", "splits_a",
                                                            "splits_b", "tiles_a")}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


_PTRS = {"X": "*bf16", "B": "*bf16", "Y": "*bf16", "WS": "*fp32", "CNT": "*i32"}
#: The scale layouts the kernels meet on CUDA: each type's compact one (formats.DEVICE_LAYOUTS), and a
#: DIRECT float32 part (one moved from the CPU: PackedPart.to).
SCALE_CASES = ["f32", "Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_K", "Q6_K"]


def _scale_case(case: str):
    """``(layout, signature of S/MN/SUP, constexprs SCALES/MINS)`` of a SCALE_CASES entry: what
    quant_gemm._scale_args passes for such a part (an absent min or sup: the scale's pointer)."""
    from monobatch.quant.formats import DEVICE_LAYOUTS, DIRECT, FACTORED, Layout
    if case == "f32":
        return Layout(True, 32), {"S": "*fp32", "MN": "*fp32", "SUP": "*fp32"}, dict(SCALES=DIRECT, MINS=DIRECT)
    layout = DEVICE_LAYOUTS[T[case]]
    s = "*fp16" if layout.scales == DIRECT else ("*i8" if case == "Q6_K" else "*u8")
    mn = {DIRECT: "*fp16", FACTORED: "*u8"}.get(layout.mins, s)
    sup = "*fp16" if layout.super_block == 256 else s
    return layout, {"S": s, "MN": mn, "SUP": sup}, dict(SCALES=layout.scales, MINS=layout.mins)


def _ptxas_usage(ptx: str) -> tuple[int, int]:
    """``(registers, spill bytes)`` of a kernel's PTX by Triton's bundled ptxas (sm_90a: what
    Triton targets on the H200)."""
    import re
    import subprocess
    import tempfile
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        err = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", err).group(1))
    spills = sum(int(v) for v in re.findall(r"(\d+) bytes spill", err))
    return regs, spills


def _check_pdl(ptx: str) -> None:
    import re
    assert ptx.count("griddepcontrol.wait") == 1
    before, after = ptx.split("griddepcontrol.wait", 1)
    assert not re.search(r"\bst\.global|\batom\.|\bred\.|\bcp\.async", before)
    assert "griddepcontrol.launch_dependents" in after


@pytest.mark.parametrize("case", SCALE_CASES)
@pytest.mark.parametrize("variant", ["dot_bias", "gemm", "gemm_invariant", "take"])
def test_kernels_compile_for_sm90(case, variant):
    """Every kernel variant compiles for sm_90 with bf16 activations (what the H200 runs; the
    interpreter does not compile) on every scale layout of CUDA; the GEMV with PDL touches nothing
    before ``griddepcontrol.wait`` but its first weight tile (loads only: kernels/pdl.py's rule).
    The FMA GEMV: below."""
    Q = _sm90_quant_gemm(check_ptxas=False)
    layout, scale_sig, codes = _scale_case(case)
    q4, group = layout.q4, layout.group
    sig = {**_PTRS, **scale_sig, "QS": "*u8" if q4 else "*i8"}
    if variant == "take":
        _sm90(Q._take_kernel, dict(BT=4, BW=512, Q4=q4, GROUP=group, **codes), {**sig, "IDS": "*i64"}, num_warps=4)
        return
    if variant.startswith("gemm"):
        bm, bn, bk, warps, stages = Q.INVARIANT_TILE if variant == "gemm_invariant" else Q.gemm_config(2048, 4096)
        c = dict(HAS_BIAS=False, BM=bm, BN=bn, BW=bk // 2 if q4 else bk, GROUP_M=8, IEEE=False, Q4=q4, GROUP=group,
                 **codes)
        ptx = _sm90(Q._gemm_kernel, c, sig, num_warps=warps, num_stages=stages)
        assert "mma" in ptx
        return
    bn, bk, _, warps, stages, _ = Q.gemv_config(4096, 4096, 16, layout)
    c = dict(HAS_BIAS=True, M_PAD=16, BLOCK_N=bn, BW=bk // 2 if q4 else bk, STAGES=stages, IEEE=False, Q4=q4,
             GROUP=group, GATED=False, **codes)
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401  (Triton >= 3.4)
    except ImportError:
        ptx = _sm90(Q._gemv_kernel, {**c, "PDL": False}, sig, num_warps=warps)
        return
    _check_pdl(_sm90(Q._gemv_kernel, {**c, "PDL": True}, sig, num_warps=warps, launch_pdl=True))
    assert "griddepcontrol" not in _sm90(Q._gemv_kernel, {**c, "PDL": False}, sig, num_warps=warps)


@pytest.mark.parametrize("case", SCALE_CASES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_fma_gemv_compiles_for_sm90(case, rows):
    """The FMA GEMV at its default config for llama-1b's gate/up (rows 2: the gated input, bias)
    compiles for sm_90 on every scale layout of CUDA with no register spills, its packed bytes in
    16-byte loads (``cp.async`` of 16 bytes into a pipeline's buffers, ``ld.global.v4`` for the
    tile before the loop), no int-to-float conversion (the factored scales' bytes too), and PDL's rule."""
    import re
    Q = _sm90_quant_gemm()
    layout, scale_sig, codes = _scale_case(case)
    q4, group = layout.q4, layout.group
    bn, bk, _, warps, stages, _ = Q.gemv_config(16384, 2048, rows, layout, "fma")
    gw = 4 if q4 else group // 4  # int32 words a group
    c = dict(HAS_BIAS=rows == 2, ROWS=rows, M_PAD=Q._pow2(rows), BLOCK_N=bn, NG=bk // (2 if q4 else 1) // (4 * gw),
             GW=gw, STAGES=stages, Q4=q4, GATED=rows == 2, EVEN=True, PDL=True, SUB=256 // group, **codes)
    sig = {**_PTRS, **scale_sig, "QW": "*i32"}
    ptx = _sm90(Q._gemv_fma_kernel, c, sig, num_warps=warps, num_stages=stages, launch_pdl=True)
    _check_pdl(ptx)
    assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx)  # the first tile's bytes
    if stages > 1:  # (M = 1 runs unpipelined: every tile by ld.global.v4)
        assert re.search(r"cp\.async\.cg\.shared\.global[^;]*, 0x10", ptx)  # the pipelined tiles', 16 B each
    assert not re.search(r"cvt\.rn\.f32\.[su]32", ptx)  # the magic-number conversion only
    regs, spills = _ptxas_usage(ptx)
    assert spills == 0 and regs <= 255, (regs, spills)


def test_random_packed_dummy_weights():
    """``bench --dummy-weights --quant``'s weights (CPU here; the same code on CUDA): every linear
    layer and the embeddings packed in the type's layout, weights of std about 0.02; a K-quant on
    a shape whose widths are not multiples of 256 is refused."""
    from monobatch.errors import InvalidRequestError
    from monobatch.loader.dummy import dummy_model
    from monobatch.quant.packed import packed_supported, packed_weights
    from monobatch.quant.random_packed import random_weight
    if not packed_supported(torch.device("cpu")):
        pytest.skip("packed CPU kernels did not build")
    loaded = dummy_model("tiny", "cpu", quant="Q4_0")
    held = packed_weights(loaded.model)
    assert loaded.weights == "packed" and len(held) == 4 * 2 + 1  # qkv, o, gate_up, down a layer; the (tied) embeddings
    assert "packed" in loaded.describe_weights() and all(w.types == ("Q4_0",) for w in held)
    g = torch.Generator().manual_seed(0)
    for qtype in TYPES:
        w = random_weight(qtype, 64, 256, torch.device("cpu"), g).dequantize()
        assert 0.014 < w.std().item() < 0.028 and abs(w.mean().item()) < 0.005, qtype.name
    with pytest.raises(InvalidRequestError):
        dummy_model("tiny", "cpu", quant="Q4_K")
    with pytest.raises(InvalidRequestError):
        dummy_model("tiny", "cpu", quant="IQ2_XS")


def test_kv_pool_leaves_the_dequant_temporary(monkeypatch):
    """The KV pool's sizing on CUDA leaves room for the widest packed weight dequantized into the
    model's dtype (the temporary of a prompt step's packed product, kept in a captured graph's
    pool): dequant_scratch_bytes counts it for weights on CUDA, nothing for CPU ones."""
    from monobatch.loader.dummy import dummy_model
    from monobatch.quant.packed import PackedWeight, dequant_scratch_bytes, packed_supported
    if not packed_supported(torch.device("cpu")):
        pytest.skip("packed CPU kernels did not build")
    model = dummy_model("tiny", "cpu", quant="Q4_0").model
    assert dequant_scratch_bytes(model) == 0  # on the CPU: no such temporary
    monkeypatch.setattr(PackedWeight, "device", property(lambda self: torch.device("cuda")))
    widest = max(w.shape[0] * w.shape[1] for m in model.modules() for w in vars(m).values()
                 if isinstance(w, PackedWeight))
    assert dequant_scratch_bytes(model) == widest * model.dtype.itemsize > 0


def test_tuned_table_overrides_the_rule(tmp_path, monkeypatch, capsys):
    """A GPU's tuned table (quant_gemm.tuned_configs) gives the FMA GEMV's config of the products it
    lists (``M<M>`` keys), the rule the others'; the DOT rows (M > FMA_DEFAULT_M) never read it; ``''`` =
    no table; an unreadable table is a warning and the rule. A file holding both kinds of entries
    gives each variant its own (``dp4a`` keys: the DP4A GEMV at every M <= FMA_MAX_M); a bad DP4A
    entry is dropped with the warning."""
    import json

    from monobatch.kernels import quant_gemm as Q
    from monobatch.quant.formats import Q4, Q8_16

    monkeypatch.setattr(Q, "VARIANT", "fma")  # (the M<M> entries are FMA configs: MONOBATCH_PACKED_GEMV=fma)
    monkeypatch.setattr(Q, "_gpu_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(Q, "_TABLES", {})
    monkeypatch.setenv(Q.TABLE_ENV, "")
    rule = Q.gemv_config(4096, 14336, 1, Q4), Q.gemv_config(4096, 4096, 1, Q4), Q.gemv_config(4096, 14336, 4, Q4)
    tuned = [128, 512, 2, 8, 1, False]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"configs": {Q.table_key(4096, 14336, 1, Q4): tuned,
                                            Q.table_key(4096, 14336, 4, Q4): tuned}}))
    monkeypatch.setattr(Q, "_TABLES", {})
    monkeypatch.setenv(Q.TABLE_ENV, str(path))
    assert Q.gemv_config(4096, 14336, 1, Q4) == tuple(tuned) != rule[0]
    assert Q.gemv_config(4096, 4096, 1, Q4) == rule[1]  # not listed
    assert Q.gemv_config(4096, 14336, 4, Q4) == rule[2]  # a DOT row: the M<M> entries are the FMA variant's
    assert Q.gemv_config(4096, 14336, 1, Q4, table=False) == rule[0]  # the probe's baseline
    path.write_text("{not json")
    monkeypatch.setattr(Q, "_TABLES", {})
    assert Q.gemv_config(4096, 14336, 1, Q4) == rule[0]
    assert "not read" in capsys.readouterr().err
    bad = [256, 512, 2, 8, 1, False]  # BLOCK_K 512 at K = 256: refused at load, not in a decode step
    path.write_text(json.dumps({"device": "Other GPU", "configs": {Q.table_key(4096, 14336, 1, Q4): tuned,
                                                                   Q.table_key(4096, 256, 1, Q4): bad}}))
    monkeypatch.setattr(Q, "_TABLES", {})
    assert Q.gemv_config(4096, 14336, 1, Q4) == tuple(tuned)
    assert Q.gemv_config(4096, 256, 1, Q4) == Q.gemv_config(4096, 256, 1, Q4, table=False)
    err = capsys.readouterr().err
    assert "1 entries dropped" in err and "tuned on 'Other GPU'" in err
    dp4a, spills = [32, 1024, 7, 4, 1, Q.DP4A], [128, 1024, 2, 4, 1, Q.DP4A]  # (spills: valid but for its bytes)
    path.write_text(json.dumps({"configs": {Q.table_key(4096, 14336, 1, Q4): tuned, Q.dp4a_key(4096, 14336, Q4): dp4a,
                                            Q.dp4a_key(4096, 4096, Q4): spills}}))
    monkeypatch.setattr(Q, "_TABLES", {})
    assert Q.gemv_config(4096, 14336, 1, Q4) == tuple(tuned)
    for M in range(1, Q.FMA_MAX_M + 1):
        assert Q.gemv_config(4096, 14336, M, Q4, "dp4a") == tuple(dp4a)
    assert Q.gemv_config(4096, 4096, 1, Q4, "dp4a") == Q.dp4a_config(4096, 4096, Q4)  # dropped: the rule
    assert "1 entries dropped" in capsys.readouterr().err


def test_packaged_tuned_tables_are_valid():
    """Every packaged table (kernels/configs/packed_gemv_*.json) names real layouts and gives
    configs gemv() takes: BLOCK_N and BLOCK_K / (2 for Q4) powers of two, BLOCK_K a multiple of
    32, at most K, split-K within K's steps, the FMA variant at M <= FMA_MAX_M (``M<M>`` keys) or
    the DP4A one (``dp4a`` keys)."""
    import json
    from pathlib import Path

    from monobatch.kernels import quant_gemm as Q
    from monobatch.quant.formats import DEVICE_LAYOUTS, PACKED_TYPES

    names = {l.name for l in PACKED_TYPES.values()} | {l.name for l in DEVICE_LAYOUTS.values()}
    files = sorted((Path(Q.__file__).parent / "configs").glob("packed_gemv_*.json"))
    assert files
    for f in files:
        doc = json.loads(f.read_text())
        assert doc["configs"] and doc["device"], f
        for key, cfg in doc["configs"].items():
            assert key.split()[0] in names, key
            assert Q.entry_problem(key, tuple(cfg)) is None, (key, Q.entry_problem(key, tuple(cfg)))
    assert Q.entry_problem("Q4/32:f8 64x64 M1", (32, 1024, 1, 4, 1, False)) == "BLOCK_N or BLOCK_K off"
    assert Q.entry_problem("Q4/32 64x4096 M8", (32, 1024, 1, 4, 1, False)).startswith("not an FMA")
    assert Q.entry_problem("Q4/32 64x4096", (32, 1024, 1, 4, 1, False)).startswith("not a")
    # DP4A entries: "... dp4a" keys only, BLOCK_K / 32 a power of two, at most DP4A_MAX_BYTES a thread
    assert Q.entry_problem("Q4/32 4096x4096 dp4a", (64, 512, 8, 4, 1, Q.DP4A)) is None
    assert Q.entry_problem("Q8/16:k0 4096x4096 dp4a", (64, 256, 8, 4, 1, Q.DP4A)) is None
    assert Q.entry_problem("Q4/32 4096x4096 dp4a", (64, 512, 8, 4, 1, False)) == "not a DP4A config"
    assert Q.entry_problem("Q4/32 4096x4096 dp4a", (64, 512, 8, 4, 1, True)) == "not a DP4A config"
    assert Q.entry_problem("Q4/32 4096x4096 M1", (64, 512, 8, 4, 1, Q.DP4A)).startswith("not an FMA")
    assert Q.entry_problem("Q4/32 4096x4096 dp4a", (64, 96, 8, 4, 1, Q.DP4A)) == "BLOCK_N or BLOCK_K off"
    assert Q.entry_problem("Q4/32 4096x4096 dp4a", (64, 512, 8, True, 1, Q.DP4A)) == "not six integers"
    assert Q.entry_problem("Q4/32 4096x4096 M1", (64, 512, 8, 4, 1, 0)).startswith("not an FMA")
    assert "spills" in Q.entry_problem("Q4/32 4096x4096 dp4a", (128, 512, 8, 4, 1, Q.DP4A))
    assert "spills" in Q.entry_problem("Q8/16:k0 4096x4096 dp4a", (64, 512, 8, 4, 1, Q.DP4A))


def test_packed_gemv_table_script():
    """scripts/packed_gemv_table.py keeps a product's best config only where it beat the rule by
    --min-gain, and the faster of two rows of one key."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "packed_gemv_table", Path(__file__).resolve().parents[1] / "scripts" / "packed_gemv_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    row = dict(best=True, type="Q4_K", layout="Q4/32:k", shape="llama-8b", layer="down", M=1, N=4096, K=14336)
    lines = ["# header", "not json",
             json.dumps({**row, "cfg": [128, 512, 2, 8, 1, False], "us": 80.0, "rule_us": 100.0}),
             json.dumps({**row, "shape": "other", "cfg": [64, 512, 1, 4, 1, False], "us": 70.0, "rule_us": 100.0}),
             json.dumps({**row, "N": 2048, "cfg": [32, 512, 1, 4, 1, False], "us": 99.0, "rule_us": 100.0}),
             json.dumps({"bench": True})]
    configs, report, timed = mod.table(lines, 0.03)
    assert configs == {"Q4/32:k 4096x14336 M1": [64, 512, 1, 4, 1, False]}
    assert len(report) == 3 and report[2].startswith("rule ")
    assert timed == {"Q4/32:k 4096x14336 M1", "Q4/32:k 2048x14336 M1"}
    # the DP4A GEMV's rows (--variant dp4a): one entry for every M, from the M = 1 row
    dp4a = dict(row, variant="dp4a", cfg=[32, 1024, 4, 4, 1, 2], us=80.0, rule_us=100.0)
    configs, _, timed = mod.table(lines + [json.dumps(dp4a), json.dumps({**dp4a, "M": 2, "us": 50.0})], 0.03)
    assert configs == {"Q4/32:k 4096x14336 M1": [64, 512, 1, 4, 1, False],
                       "Q4/32:k 4096x14336 dp4a": [32, 1024, 4, 4, 1, 2]}
    # merging into a GPU's file: untimed products kept, a re-timed one takes the new result (the rule: gone)
    old = {"Q4/32:k 2048x14336 M1": [16, 512, 1, 4, 1, False], "Q4/32:k 1x1 M1": [8, 64, 1, 1, 1, False],
           "Q4/32:k 4096x14336 dp4a": [64, 256, 9, 4, 1, 2]}
    assert mod.merge(old, configs, timed) == {**configs, "Q4/32:k 1x1 M1": [8, 64, 1, 1, 1, False]}


def test_packed_gemv_table_script_merges_into_one_gpus_file(tmp_path):
    """The script end to end: it merges into the table at -o (an untimed product's entry kept), and
    refuses a file tuned on another GPU unless --replace."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "packed_gemv_table.py"
    probe, out = tmp_path / "probe.jsonl", tmp_path / "t.json"
    probe.write_text(json.dumps(dict(best=True, variant="dp4a", type="Q4_K", layout="Q4/32:k", shape="s", layer="l",
                                     M=1, N=64, K=4096, cfg=[32, 1024, 2, 4, 1, 2], us=8.0, rule_us=10.0)) + "\n")
    kept = {"Q4/32:k 64x64 M1": [64, 64, 1, 4, 1, False]}
    out.write_text(json.dumps({"device": "GPU A", "configs": kept}))

    def run(*args):
        return subprocess.run([sys.executable, str(script), str(probe), "-o", str(out), *args], capture_output=True,
                              text=True, timeout=60)

    res = run("--device", "GPU B")
    assert res.returncode == 2 and "was tuned on 'GPU A', not 'GPU B'" in res.stderr, res.stderr
    assert run("--device", "GPU A").returncode == 0
    assert json.loads(out.read_text())["configs"] == {**kept, "Q4/32:k 64x4096 dp4a": [32, 1024, 2, 4, 1, 2]}
    assert run("--device", "GPU B", "--replace").returncode == 0
    assert json.loads(out.read_text()) == {"device": "GPU B", "source": json.loads(out.read_text())["source"],
                                           "min_gain": 0.03, "configs": {"Q4/32:k 64x4096 dp4a": [32, 1024, 2, 4, 1, 2]}}


def test_probe_dp4a_best_keeps_the_other_rows():
    """scripts/probe_quant_cuda.py's DP4A pick (PROBE_MS=1,4): the fastest config at M = 1 among
    those not more than DP4A_OTHER_M_SLACK slower than the rule at every other timed M (a DP4A
    entry serves every M <= 4); the rule itself where nothing else qualifies."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "probe_quant_cuda", Path(__file__).resolve().parents[1] / "scripts" / "probe_quant_cuda.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rule, fast_1 = (64, 512, 8, 4, 1, 2), (32, 2048, 1, 8, 1, 2)
    fast_both, slow_4 = (32, 512, 4, 4, 1, 2), (16, 512, 1, 2, 1, 2)
    times = {rule: {1: 10.0, 4: 20.0}, fast_1: {1: 6.0, 4: 25.0}, fast_both: {1: 8.0, 4: 20.5},
             slow_4: {1: 7.0, 4: 40.0}}
    assert mod.dp4a_best(times, rule) == (fast_both, {4: [20.5, 20.0]})
    assert mod.dp4a_best({rule: {1: 10.0, 4: 20.0}, fast_1: {1: 6.0, 4: 25.0}}, rule) == (rule, {4: [20.0, 20.0]})
    assert mod.dp4a_best({rule: {1: 10.0}, fast_1: {1: 6.0}}, rule) == (fast_1, {})  # M = 1 alone: the fastest
    assert mod.dp4a_best({rule: {4: 20.0}}, rule) is None


def test_probe_dp4a_tiles_variable(monkeypatch):
    """PROBE_DP4A_TILES replaces the probe's DP4A tiles (a short sweep), and a malformed value stops it."""
    import importlib.util
    from pathlib import Path

    from monobatch.kernels import quant_gemm as Q
    from monobatch.quant.formats import DEVICE_LAYOUTS

    def load():
        spec = importlib.util.spec_from_file_location(
            "probe_quant_cuda", Path(__file__).resolve().parents[1] / "scripts" / "probe_quant_cuda.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    monkeypatch.setenv("PROBE_DP4A_TILES", "64,256,4,1; 32,512,2,1")
    monkeypatch.setenv("PROBE_VARIANT", "dp4a")
    mod = load()
    assert mod.DP4A_SWEEP == [(64, 256, 4, 1), (32, 512, 2, 1)]
    configs = mod.dp4a_sweep_configs(4096, 14336, DEVICE_LAYOUTS[T.Q4_K])
    assert configs and {c[:2] + c[3:5] for c in configs} == {(64, 256, 4, 1), (32, 512, 2, 1)}
    assert all(c[5] == Q.DP4A for c in configs)
    for bad in ("64,256,4", "64,256,four,1", ";"):
        monkeypatch.setenv("PROBE_DP4A_TILES", bad)
        with pytest.raises(SystemExit, match="PROBE_DP4A_TILES"):
            load()


#: A GGUF type of each compact layout name (the tuned tables' keys; device_repack's layouts).
TABLE_TYPES = {layout.name: qtype for qtype, layout in reversed(DEVICE_LAYOUTS.items())}


def check_table_configs(device: str = "cpu") -> str:
    """Every tile the packaged tuned tables give (kernels/configs/*.json: BLOCK_N, BLOCK_K, warps,
    stages, on its layout) computes its GEMV to the float64 reference, unsplit and split, on an N
    off the tile and on whole tiles (the unmasked loads, as every tabled product), K of two steps:
    an FMA entry's at M = 1; a DP4A entry's (``... dp4a``: every M <= FMA_MAX_M) at M = 1 and 4,
    against x after its int8 round trip (:func:`dp4a_x`, DP4A_TOL); on CUDA also every entry at its
    own N x K with its own split, bf16 x (DP4A entries at M = 1 and 4). The table that
    ``MONOBATCH_PACKED_GEMV_CONFIGS`` names, when set, is checked beside the packaged ones."""
    import json
    import os
    from pathlib import Path

    from monobatch.kernels import quant_gemm as Q

    def ref_tol(x, w, dp4a):
        return ((dp4a_x(x)[0] if dp4a else x.double()) @ w.T), (DP4A_TOL if dp4a else tol)

    files = sorted((Path(Q.__file__).parent / "configs").glob("packed_gemv_*.json"))
    if os.environ.get(Q.TABLE_ENV) and Path(os.environ[Q.TABLE_ENV]).resolve() not in {f.resolve() for f in files}:
        files.append(Path(os.environ[Q.TABLE_ENV]))
    tables = [json.loads(f.read_text())["configs"] for f in files]
    tiles = {(key.split()[0], bn, bk, warps, stages, dot) for t in tables
             for key, (bn, bk, _splits, warps, stages, dot) in t.items()}
    g = torch.Generator().manual_seed(11)
    dt, tol = (torch.float32, REL_TOL) if device == "cpu" else (torch.bfloat16, BF16_TOL)
    for i, (layout, bn, bk, warps, stages, dot) in enumerate(sorted(tiles)):
        qtype = TABLE_TYPES[layout]
        for n in (bn + 8, 2 * bn):
            k = 2 * max(bk, 256)
            rep, w = _parts(qtype, n, k, seed=60 + i, device=device)
            assert rep.layout.name == layout, (rep.layout.name, layout)
            for m in (1, Q.FMA_MAX_M) if dot == Q.DP4A else (1,):
                x = torch.randn(m, k, generator=g).to(device, dt)
                ref, bound = ref_tol(x, w, dot == Q.DP4A)
                for splits in (1, 2):
                    got = Q.gemv(x, rep, config=(bn, bk, splits, warps, stages, dot), out_dtype=torch.float32)
                    assert _rel(got, ref) <= bound, (layout, n, m, bn, bk, splits, warps, stages, dot)
    if device != "cpu":  # every entry at its product's own shape (8b's: up to 128256 x 4096)
        for t in tables:
            for key, cfg in t.items():
                layout, n, k = key.split()[0], *map(int, key.split()[1].split("x"))
                rep, w = _parts(TABLE_TYPES[layout], n, k, seed=7, device=device)
                for m in (1, Q.FMA_MAX_M) if cfg[5] == Q.DP4A else (1,):
                    x = torch.randn(m, k, generator=g).to(device, dt)
                    ref, bound = ref_tol(x, w, cfg[5] == Q.DP4A)
                    assert _rel(Q.gemv(x, rep, config=tuple(cfg), out_dtype=torch.float32), ref) <= bound, (key, m)
                del rep, w
    return "ok"


def test_table_configs_in_interpreter():
    run_in_triton_interpreter("test_quant_cuda", "check_table_configs")


def test_table_configs_cuda():
    _cuda()
    assert check_table_configs("cuda") == "ok"


# ------------------------------------------------------------------ the DP4A GEMV (MONOBATCH_PACKED_GEMV=dp4a)

#: The DP4A GEMV against float64 ``(d xi) W^T`` (x after its int8 round trip, :func:`dp4a_x`):
#: |y - ref| / max |ref|. The group dots are exact integers; only the per-group float32 scaling
#: and the float32 accumulation round (observed ~1e-7 in the interpreter).
DP4A_TOL = 1e-5
#: The DP4A GEMV's layouts: Q4/32 (Q4_0's NEG8, Q4_1's direct float16 scale and min, Q4_K's factored),
#: Q8/32 (Q8_0's direct scale and ZERO min, Q5_K's factored scale and min: signed words, a weight
#: group a x group) and Q8/16 (Q6_K's factored scale, ZERO min: two weight groups a x group).
DP4A_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0, T.Q5_K, T.Q6_K)
#: The types check_dp4a_gemv also runs bias, the gated input and an ``out`` slice on (a Q4 and a Q8
#: layout each of NEG8 / ZERO and of factored scales).
DP4A_FEATURE_TYPES = (T.Q4_0, T.Q4_K, T.Q8_0, T.Q6_K)


def dp4a_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` as the DP4A GEMV rounds it (q8_1 per 32 columns, float32 torch ops with the
    kernel's roundings: ``d = amax / 127``, ``xi = x * (127 / amax)`` rounded half away from zero)
    -> ``(d xi, d)`` float64 ``[M, K]`` each (d repeated over its group's columns)."""
    M, K = x.shape
    xg = x.float().reshape(M, K // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    # The IEEE float32 quotients, as the kernel's div_rn rounds them: a float64 quotient of float32
    # operands rounded to float32 is the correctly rounded float32 one (53 >= 2 * 24 + 2). Not
    # ``127.0 / amax`` (torch computes it as ``amax.reciprocal() * 127``: 8 of 24 groups one ulp
    # off on the H100's test row, one xi off by one) nor, on CUDA, ``amax / 127.0`` (a product with
    # the scalar's reciprocal).
    d = (amax.double() / 127.0).float()
    inv = torch.where(amax > 0, (127.0 / amax.clamp_min(1e-30).double()).float(), torch.zeros_like(amax))
    v = xg * inv
    r = torch.floor(v.abs() + 0.5)
    xi = torch.where(v < 0, -r, r)
    return (xi.double() * d.double()).reshape(M, K), d.double().expand(M, K // 32, 32).reshape(M, K)


def _dp4a_ok(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what) -> None:
    """``y`` (the DP4A GEMV of x, no bias) within DP4A_TOL of ``(d xi) W^T``, and within the int8
    activation's bound of the unrounded ``x W^T``: ``sum_k |x_k - d xi_k| |w_nk|`` with
    ``|x_k - d xi_k| <= d / 2`` (times 1 + 1e-3, plus DP4A_TOL: the roundings of 127 / amax)."""
    xq, d = dp4a_x(x)
    ref = xq @ w.T
    assert _rel(y, ref) <= DP4A_TOL, (what, _rel(y, ref))
    bound = (d / 2) @ w.abs().T
    err = (y.double() - x.double() @ w.T).abs()
    assert bool((err <= bound * (1 + 1e-3) + DP4A_TOL * ref.abs().max()).all()), what


def check_dp4a_gemv(device: str = "cpu", types: tuple = DP4A_TYPES) -> str:
    """The DP4A GEMV (fp32 x in the interpreter, bf16 on CUDA) on each layout of ``types`` at
    M = 1..4: N = 40 (off the tile), K of 3 steps of 256 weights with split-K off and on (2
    slices, the last short), and N = 32 with whole tiles and steps of 128 (the unmasked loads,
    split); on DP4A_FEATURE_TYPES also bias (M = 2), the gated input (M = 3: the bits of the
    product of silu_mul's output) and a column slice of a wider bf16 ``out`` (M = 4: the bits of
    a bf16 ``out_dtype`` result, the other columns left alone)."""
    from monobatch.kernels import quant_gemm as Q
    from monobatch.kernels.fused import silu_mul
    g = torch.Generator().manual_seed(13)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    for qtype in types:
        i = DP4A_TYPES.index(qtype)
        for n, k, cfgs, ms in ((40, 768, [(16, 256, 1, 4, 1, Q.DP4A), (32, 256, 2, 4, 2, Q.DP4A)], (1, 2, 3, 4)),
                               (32, 512, [(16, 128, 2, 4, 1, Q.DP4A)], (1, 4))):
            rep, w = _parts(qtype, n, k, seed=40 + i, device=device)
            bias = torch.randn(n, generator=g).to(device)
            for M in ms:
                x = torch.randn(M, k, generator=g).to(device, dt)
                cfg = cfgs[M % len(cfgs)]
                y = Q.gemv(x, rep, config=cfg, out_dtype=torch.float32)
                _dp4a_ok(y, x, w, (qtype.name, n, k, M, cfg))
                if n == 32 or qtype not in DP4A_FEATURE_TYPES:
                    continue
                if M == 2:
                    yb = Q.gemv(x, rep, bias, config=cfg, out_dtype=torch.float32)
                    assert torch.allclose(yb, y + bias, rtol=0, atol=1e-6 * y.abs().max().item()), (qtype.name, M)
                if M == 3:
                    gu = (torch.randn(M, 2 * k, generator=g) * 3).to(device, dt)
                    got = Q.gemv(gu, rep, bias, config=cfg, gated=True)
                    assert torch.equal(got, Q.gemv(silu_mul(gu), rep, bias, config=cfg)), (qtype.name, M, cfg)
                if M == 4:
                    wide = torch.full((M, n + 24), 7.0, device=device, dtype=torch.bfloat16)
                    Q.gemv(x, rep, config=cfg, out=wide[:, 8:8 + n])
                    assert torch.equal(wide[:, 8:8 + n], Q.gemv(x, rep, config=cfg, out_dtype=torch.bfloat16))
                    assert _rel(wide[:, 8:8 + n], y.double()) <= 2.0**-7, qtype.name  # (interpreter: truncated)
                    assert bool((wide[:, :8] == 7).all() and (wide[:, 8 + n:] == 7).all())
        with pytest.raises(ValueError):
            Q.gemv(torch.zeros(Q.FMA_MAX_M + 1, 512, device=device, dtype=dt), rep, config=(16, 128, 1, 4, 1, Q.DP4A))
    return "ok"


def check_dp4a_rows(device: str = "cpu") -> str:
    """Every row of an M = 4 DP4A call (Q4_K, Q6_K: its default config, gemv_config(..., "dp4a"),
    the same at every M; Q4_0, Q8_0: split in 3 slices, gated) has the bits of that row alone: each
    row is quantized and summed on its own, in the same order whatever M; a NaN in a row's x
    makes that row NaN and leaves the others' bits."""
    from monobatch.kernels import quant_gemm as Q
    g = torch.Generator().manual_seed(17)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    for i, qtype in enumerate((T.Q4_0, T.Q4_K, T.Q8_0, T.Q6_K)):
        n, k = 48, 512
        rep, _ = _parts(qtype, n, k, seed=50 + i, device=device)
        cfg = Q.gemv_config(n, k, 4, rep.layout, "dp4a")
        assert cfg[5] == Q.DP4A and all(Q.gemv_config(n, k, m, rep.layout, "dp4a") == cfg for m in (1, 2, 3))
        # Q4_0 split in 3 slices with the gated input; Q4_K the default config
        c, gated = ((16, 128, 3, 4, 1, Q.DP4A), True) if qtype in (T.Q4_0, T.Q8_0) else (cfg, False)
        x = torch.randn(4, 2 * k if gated else k, generator=g).to(device, dt)
        y = Q.gemv(x, rep, config=c, gated=gated)
        for r in range(4):
            assert torch.equal(y[r:r + 1], Q.gemv(x[r:r + 1], rep, config=c, gated=gated)), (qtype.name, c, r)
        # a NaN in a row's x makes that row's outputs NaN (its group's d is NaN, as the FMA and DOT
        # variants propagate it), not a finite number; the other rows keep their bits
        x[1, 37] = float("nan")
        z = Q.gemv(x, rep, config=c, gated=gated)
        assert z[1].isnan().all() and torch.equal(z[[0, 2, 3]], y[[0, 2, 3]]), qtype.name
    return "ok"


def check_dp4a_dispatch(device: str = "cpu") -> str:
    """With VARIANT = "dp4a" (MONOBATCH_PACKED_GEMV=dp4a), quant_gemm.matmul at M = 1 computes a
    part of every layout (Q4_0, Q4_K, Q8_0, Q6_K) by the DP4A kernel (bitwise gemv with
    dp4a_config, not the FMA kernel's result)."""
    from monobatch.kernels import quant_gemm as Q
    g = torch.Generator().manual_seed(19)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    with gemv_variant("dp4a"):
        for qtype in (T.Q4_0, T.Q4_K, T.Q8_0, T.Q6_K):
            n, k = 40, 512
            rep, _ = _parts(qtype, n, k, seed=3, device=device)
            x = torch.randn(1, k, generator=g).to(device, dt)
            y = Q.matmul(x, rep)
            fma = Q.gemv(x, rep, config=Q.gemv_config(n, k, 1, rep.layout, "fma"))
            assert torch.equal(y, Q.gemv(x, rep, config=Q.dp4a_config(n, k, rep.layout))), qtype.name
            assert not torch.equal(y, fma), qtype.name
    return "ok"


def check_dp4a_pair(device: str = "cpu") -> str:
    """Two parts of one weight in one DP4A launch (quant_gemm.gemv_pair, MONOBATCH_PACKED_GEMV_PAIR=1;
    a Q4_K_M file's qkv: Q4_K q and k, Q6_K v): each part's columns have the bits of its own launch
    (the same config, split and warps) at M = 1..3, split and unsplit parts, with bias and a gated
    input, and through
    PackedWeight.cuda_matmul; it declines (False) with the switch off, above PAIR_MAX_M rows, one part,
    or configs of other warps."""
    from monobatch.kernels import common
    from monobatch.kernels import quant_gemm as Q
    from monobatch.quant.packed import PackedPart, PackedWeight
    g = torch.Generator().manual_seed(23)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    saved, Q.PAIR = Q.PAIR, True
    try:
        with gemv_variant("dp4a"):
            for (ta, na), (tb, nb), k in (((T.Q4_K, 80), (T.Q6_K, 48), 512), ((T.Q4_0, 64), (T.Q8_0, 40), 768),
                                          ((T.Q6_K, 48), (T.Q4_K, 80), 512),  # (the first part split more)
                                          ((T.Q4_K, 80), (T.Q4_0, 48), 512)):  # (neither split)
                a, _ = _parts(ta, na, k, seed=61, device=device)
                b, _ = _parts(tb, nb, k, seed=62, device=device)
                bias = torch.randn(na + nb, generator=g).to(device)
                for M in (1, 2, 3):
                    gated = M == 3
                    x = torch.randn(M, 2 * k if gated else k, generator=g).to(device, dt)
                    bb = bias if M == 2 else None
                    y = torch.full((M, na + nb), 7.0, device=device, dtype=dt)
                    assert Q.gemv_pair(x, [a, b], y, bb, gated), (ta.name, M)
                    ya = Q.gemv(x, a, None if bb is None else bb[:na], gated=gated)
                    yb = Q.gemv(x, b, None if bb is None else bb[na:], gated=gated)
                    assert torch.equal(y[:, :na], ya) and torch.equal(y[:, na:], yb), (ta.name, tb.name, M)
                    cnt = common.COUNTERS.get(x.device)
                    assert cnt is None or int(cnt.count_nonzero()) == 0  # the split counters left zeroed
                w = PackedWeight([PackedPart(**_part_fields(a)), PackedPart(**_part_fields(b))], k, (ta.name, tb.name))
                x = torch.randn(1, k, generator=g).to(device, dt)
                y = torch.empty(1, na + nb, device=device, dtype=dt)
                assert Q.gemv_pair(x, [a, b], y)
                assert torch.equal(w.cuda_matmul(x), y)  # (the CUDA route, also on the interpreter's CPU tensors)
                assert not Q.gemv_pair(torch.zeros(Q.PAIR_MAX_M + 1, k, device=device, dtype=dt), [a, b],
                                       torch.empty(Q.PAIR_MAX_M + 1, na + nb, device=device, dtype=dt))
                assert not Q.gemv_pair(x, [a], torch.empty(1, na, device=device, dtype=dt))
                with pytest.raises(ValueError):
                    Q.gemv_pair(x, [a, b], torch.empty(1, na, device=device, dtype=dt))
            # configs of other warps: declined (one launch has one warps)
            table = {Q.dp4a_key(na, k, a.layout): (64, 512, 1, 8, 1, Q.DP4A)}
            saved_table = Q._TABLES.copy()
            Q._TABLES.clear()
            Q._TABLES.update({Q._gpu_name(x.device): table})
            try:
                assert Q.gemv_config(na, k, 1, a.layout, "dp4a", device=x.device)[3] == 8
                assert not Q.gemv_pair(x, [a, b], y)
            finally:
                Q._TABLES.clear()
                Q._TABLES.update(saved_table)
        Q.PAIR = False
        assert not Q.gemv_pair(x, [a, b], y)
    finally:
        Q.PAIR = saved
    return "ok"


def _part_fields(rep) -> dict:
    """A repacked part's fields as :class:`PackedPart`'s keyword arguments."""
    return dict(layout=rep.layout, qs=rep.qs, scale=rep.scale, minimum=rep.minimum, sup=rep.sup)


def test_dp4a_pair_in_interpreter():
    run_in_triton_interpreter("test_quant_cuda", "check_dp4a_pair")


def test_dp4a_pair_cuda():
    _cuda()
    assert check_dp4a_pair("cuda") == "ok"


def check_dp4a_gemv_q4_0() -> str:
    return check_dp4a_gemv(types=(T.Q4_0,))


def check_dp4a_gemv_q4_1() -> str:
    return check_dp4a_gemv(types=(T.Q4_1,))


def check_dp4a_gemv_q4_k() -> str:
    return check_dp4a_gemv(types=(T.Q4_K,))


def check_dp4a_gemv_q8_0() -> str:
    return check_dp4a_gemv(types=(T.Q8_0,))


def check_dp4a_gemv_q5_k() -> str:
    return check_dp4a_gemv(types=(T.Q5_K,))


def check_dp4a_gemv_q6_k() -> str:
    return check_dp4a_gemv(types=(T.Q6_K,))


@pytest.mark.parametrize("qtype", DP4A_TYPES, ids=lambda t: t.name)
def test_dp4a_gemv_in_interpreter(qtype):
    run_in_triton_interpreter("test_quant_cuda", f"check_dp4a_gemv_{qtype.name.lower()}")


def test_dp4a_rows_in_interpreter():
    run_in_triton_interpreter("test_quant_cuda", "check_dp4a_rows")


def test_dp4a_dispatch_in_interpreter():
    run_in_triton_interpreter("test_quant_cuda", "check_dp4a_dispatch")


def test_dp4a_gemv_cuda():
    _cuda()
    assert check_dp4a_gemv("cuda") == "ok"


def test_dp4a_rows_cuda():
    _cuda()
    assert check_dp4a_rows("cuda") == "ok"


def test_dp4a_dispatch_cuda():
    _cuda()
    assert check_dp4a_dispatch("cuda") == "ok"


def test_dp4a_configs(monkeypatch):
    """gemv_config with the "dp4a" variant (argument or VARIANT): every layout at M <= FMA_MAX_M gets
    dp4a_config (the same for every M, 512-weight steps for Q4, 256 for Q8) unless the tuned table
    has a DP4A entry for the product (``... dp4a``, then that entry for every such M; never an FMA
    entry), M > FMA_MAX_M what "fma" gives it; an FMA key cannot hold a DP4A config."""
    from monobatch.kernels import quant_gemm as Q
    from monobatch.quant.formats import DEVICE_LAYOUTS, Q4, Q8, Q8_16
    for N, K in ((3072, 2048), (4096, 14336), (128256, 4096), (40, 64)):
        for layout in (Q4, DEVICE_LAYOUTS[T.Q4_0], DEVICE_LAYOUTS[T.Q4_K], Q8, DEVICE_LAYOUTS[T.Q8_0],
                       DEVICE_LAYOUTS[T.Q5_K], Q8_16, DEVICE_LAYOUTS[T.Q6_K]):
            for M in range(1, Q.MAX_M + 1):
                got = Q.gemv_config(N, K, M, layout, "dp4a", table=False)
                if M <= Q.FMA_MAX_M:
                    assert got == Q.dp4a_config(N, K, layout) and got[5] == Q.DP4A and got[5] is not True
                    bn, bk, splits, _, _, _ = got
                    bw = bk // (2 if layout.q4 else 1)
                    assert bk == min(512 if layout.q4 else 256, Q._pow2(K)) and bw & (bw - 1) == 0
                    assert bk % 32 == 0 and 1 <= splits <= -(-K // bk)
                else:
                    assert got == Q.gemv_config(N, K, M, layout, "fma" if M <= Q.FMA_DEFAULT_M else "dot", table=False)
    monkeypatch.setattr(Q, "VARIANT", "dp4a")
    monkeypatch.setattr(Q, "tuned_configs", lambda device=None: {Q.table_key(4096, 14336, 1, Q4): (128, 512, 2, 8, 1,
                                                                                                    False)})
    assert Q.gemv_config(4096, 14336, 1, Q4) == Q.dp4a_config(4096, 14336, Q4)
    assert Q.gemv_config(4096, 14336, 1, Q8) == Q.dp4a_config(4096, 14336, Q8)
    assert Q.gemv_config(4096, 14336, Q.FMA_MAX_M + 1, Q8)[5] is True
    assert Q.entry_problem(Q.table_key(4096, 14336, 1, Q4), (64, 512, 1, 4, 1, Q.DP4A)) is not None
    tuned = (32, 1024, 7, 4, 1, Q.DP4A)
    monkeypatch.setattr(Q, "tuned_configs", lambda device=None: {Q.dp4a_key(4096, 14336, Q4): tuned})
    for M in range(1, Q.FMA_MAX_M + 1):
        assert Q.gemv_config(4096, 14336, M, Q4) == tuned
        assert Q.gemv_config(4096, 14336, M, Q4, table=False) == Q.dp4a_config(4096, 14336, Q4)
        assert Q.gemv_config(4096, 14336, M, Q4, "fma") == Q.gemv_config(4096, 14336, M, Q4, "fma", table=False)
    assert Q.gemv_config(4096, 4096, 1, Q4) == Q.dp4a_config(4096, 4096, Q4)  # not listed
    assert Q.gemv_config(4096, 14336, Q.FMA_MAX_M + 1, Q4)[5] is True


def test_table_dp4a_tiles_compile_without_spills():
    """Every DP4A tile of the packaged tuned tables (``dp4a`` entries serve every M <= FMA_MAX_M)
    compiles for sm_90 at 4 rows, plain and with the gated input (the down projection), without
    register spills (ptxas): what ``entry_problem``'s DP4A_MAX_BYTES bound stands for."""
    import json
    from pathlib import Path
    Q = _sm90_quant_gemm()
    tiles = set()
    for f in sorted((Path(Q.__file__).parent / "configs").glob("packed_gemv_*.json")):
        for key, (bn, bk, _splits, warps, stages, dot) in json.loads(f.read_text())["configs"].items():
            if dot == Q.DP4A:
                tiles.add((TABLE_TYPES[key.split()[0]].name, bn, bk, warps, stages))
    for case, bn, bk, warps, stages in sorted(tiles):
        layout, scale_sig, codes = _scale_case(case)
        for gated in (False, True):
            c = dict(HAS_BIAS=False, ROWS=Q.FMA_MAX_M, M_PAD=Q._pow2(Q.FMA_MAX_M), BLOCK_N=bn, NG=bk // 32,
                     STAGES=stages, Q4=layout.q4, GROUP=layout.group, GATED=gated, EVEN=True, SUB=256 // layout.group,
                     ASM=True, PDL=True, **codes)
            ptx = _sm90(Q._gemv_dp4a_kernel, c, {**_PTRS, **scale_sig, "QW": "*i32"}, num_warps=warps,
                        num_stages=stages, launch_pdl=True)
            regs, spills = _ptxas_usage(ptx)
            assert spills == 0, (case, bn, bk, warps, stages, gated, regs, spills)


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_dp4a_pair_compiles_for_sm90(rows):
    """The two-part DP4A launch (gemv_pair) at llama-8b's mixed qkv (q and k Q4_K 5120 x 4096, v Q6_K
    1024 x 4096, each at its default config: the same warps) compiles for sm_90 without register
    spills at its rows (PAIR_MAX_M); before its first PDL wait (part A's branch; part B's is the
    same function) it stores and updates nothing."""
    import re
    Q = _sm90_quant_gemm()
    from monobatch.quant.formats import DEVICE_LAYOUTS
    sig, const = {"X": "*bf16"}, dict(ROWS=rows, M_PAD=Q._pow2(rows), GATED=False, ASM=True, PDL=True)
    for part, (qtype, n) in zip("AB", ((T.Q4_K, 5120), (T.Q6_K, 1024))):
        layout, scale_sig, codes = _scale_case(qtype.name)
        bn, bk, _, warps, stages, dot = Q.gemv_config(n, 4096, rows, layout, "dp4a")
        assert dot == Q.DP4A and (part == "A" or (warps, stages) == (const_warps, const_stages))  # noqa: F821
        const_warps, const_stages = warps, stages
        sig.update({f"{k}_{part}": v for k, v in {**_PTRS, **scale_sig, "QW": "*i32"}.items() if k != "X"})
        const.update({f"{k}_{part}": v for k, v in dict(HAS_BIAS=False, BLOCK_N=bn, NG=bk // 32, STAGES=stages,
                                                        Q4=layout.q4, GROUP=layout.group, EVEN=True,
                                                        SUB=256 // layout.group, **codes).items()})
    ptx = _sm90(Q._gemv_dp4a_pair_kernel, const, sig, num_warps=const_warps, num_stages=const_stages,
                launch_pdl=True)
    before = ptx.split("griddepcontrol.wait", 1)[0]
    assert not re.search(r"\bst\.global|\batom\.|\bred\.|\bcp\.async", before)
    regs, spills = _ptxas_usage(ptx)
    assert spills == 0 and regs <= 255, (regs, spills)


@pytest.mark.parametrize("case", ["f32", "Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 4])
def test_dp4a_gemv_compiles_for_sm90(case, rows):
    """The DP4A GEMV (ASM: inline dp4a) at its config compiles for sm_90 on the scale layouts of
    CUDA, Q8_0's (Q8/32) and Q6_K's (Q8/16) (rows 4: the gated input, bias): a dp4a a word of 4
    weights and row (Q4: two dp4a.u32.s32 a word, Q8: one dp4a.s32.s32) in the step before the
    loop and in the loop (the PTX's count), no int-to-float conversion, no register spills, PDL's rule."""
    import re
    Q = _sm90_quant_gemm()
    layout, scale_sig, codes = _scale_case(case)
    bn, bk, _, warps, stages, _ = Q.dp4a_config(4096, 14336, layout)
    c = dict(HAS_BIAS=rows == 4, ROWS=rows, M_PAD=Q._pow2(rows), BLOCK_N=bn, NG=bk // 32, STAGES=stages,
             Q4=layout.q4, GROUP=layout.group, GATED=rows == 4, EVEN=True, SUB=256 // layout.group, ASM=True,
             PDL=True, **codes)
    ptx = _sm90(Q._gemv_dp4a_kernel, c, {**_PTRS, **scale_sig, "QW": "*i32"}, num_warps=warps, num_stages=stages,
                launch_pdl=True)
    _check_pdl(ptx)
    words = rows * bn * bk // 4 // (warps * 32)  # (row, 4-weight) pairs a thread a step
    signed, unsigned = ptx.count("dp4a.s32.s32"), ptx.count("dp4a.u32.s32")
    assert (unsigned, signed) == ((2 * words, 0) if layout.q4 else (0, 2 * words)), (unsigned, signed)
    assert not re.search(r"cvt\.rn\.f32\.[su]32", ptx)
    regs, spills = _ptxas_usage(ptx)
    assert spills == 0 and regs <= 255, (regs, spills)
