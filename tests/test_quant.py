"""Packed GGUF weights on CPU: every packed type against gguf-py's dequantization.

Random blocks (every byte pattern is a valid block once its fp16 scales are finite) of each type,
so the K-quants, which gguf-py cannot quantize, are covered as well as the types it can; plus the
bundled model's real Q4_1 and Q8_0 tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from helpers import PACKED_NEAR_TIE
from monobatch.kernels import quant_cpu
from monobatch.quant import packed
from monobatch.quant.formats import PACKED_TYPES, Q4, Repacked, narrow_scales, repack
from monobatch.quant.packed import PackedWeight

pytestmark = pytest.mark.skipif(not quant_cpu.available(), reason="packed CPU kernels did not build")

#: |packed - float64 reference| / max |reference| bound for a float32 dot product of K terms
#: (K * 2^-24 with K = 512, times 4 for the group sums): the packed kernels' documented tolerance.
REL_TOL = 4 * 512 * 2.0**-24


def random_blocks(qtype: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    """``n`` rows of ``k`` weights of ``qtype`` as raw bytes ``[n, row bytes]``: random bits, fp16
    scale fields set to finite values of either sign."""
    rng = np.random.default_rng(seed)
    bs, ts = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (n * k // bs, ts), dtype=np.uint8)
    nb = b.shape[0]

    def f16(scale: float) -> np.ndarray:
        return (rng.standard_normal(nb) * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)

    scale_fields = {T.Q4_0: [0], T.Q8_0: [0], T.Q5_0: [0], T.Q4_1: [0, 2], T.Q4_K: [0, 2], T.Q5_K: [0, 2],
                    T.Q6_K: [208]}[qtype]
    for off in scale_fields:
        b[:, off:off + 2] = f16(0.01)
    return b.reshape(n, -1)


def as_packed(qtype: T, data: np.ndarray, k: int) -> PackedWeight:
    return PackedWeight.from_repacked([(repack(qtype, data, k), qtype.name)], k)


@pytest.mark.parametrize("qtype", list(PACKED_TYPES), ids=lambda t: t.name)
def test_repack_is_gguf_dequantize(qtype):
    """Equal values; bitwise too, except Q4_0's zeros: gguf-py's ``d * (q - 8)`` is -0.0 where d < 0,
    ``fma(q, d, -8 d)`` is +0.0."""
    n, k = 24, 512
    data = random_blocks(qtype, n, k)
    ref = dequantize(data, qtype).reshape(n, k).astype(np.float32)
    got = as_packed(qtype, data, k).dequantize().numpy()
    assert np.array_equal(got, ref)
    if qtype != T.Q4_0:
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("qtype", list(PACKED_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_matmul_matches_float64_reference(qtype, rows):
    n, k = 40, 512
    data = random_blocks(qtype, n, k, seed=rows)
    w = torch.from_numpy(dequantize(data, qtype).reshape(n, k)).double()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n)
    ref = x.double() @ w.T + bias.double()
    got = as_packed(qtype, data, k).matmul(x, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert ((got.double() - ref).abs().max() / ref.abs().max()).item() <= REL_TOL


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_rows_do_not_depend_on_their_neighbours(qtype):
    """A row's output is bitwise the same alone and inside any batch up to GEMV_ROWS."""
    n, k = 40, 256
    w = as_packed(qtype, random_blocks(qtype, n, k), k)
    x = torch.randn(packed.GEMV_ROWS, k)
    full = w.matmul(x)
    for m in range(packed.GEMV_ROWS):
        assert torch.equal(w.matmul(x[m:m + 1])[0], full[m])
    other = x.clone()
    other[1:] = torch.randn(packed.GEMV_ROWS - 1, k)
    assert torch.equal(w.matmul(other)[0], full[0])


def adversarial_rows(k: int, g: int) -> torch.Tensor:
    """Rows that stress the GEMV's int16 rounding (groups of ``g`` columns): random; one huge
    outlier a group; a zero group; a zero row; values of 1e-30 and of 1e-40 (subnormal, sx rounds
    to 0); all negative; groups of magnitudes 1e-20 to 1e20; values halfway between multiples of
    sx (ties: rounded to even)."""
    gen = torch.Generator().manual_seed(7)
    rows = [torch.randn(k, generator=gen)]
    r = torch.randn(k, generator=gen)
    r[::g] = 1e4  # one outlier a group: the other columns rounded to steps of 1e4 / 32767 ~ 0.3
    rows.append(r)
    r = torch.randn(k, generator=gen)
    r[g:2 * g] = 0
    rows += [r, torch.zeros(k), torch.randn(k, generator=gen) * 1e-30, torch.randn(k, generator=gen) * 1e-40,
             -torch.rand(k, generator=gen) - 0.5]
    r = torch.randn(k, generator=gen)
    for i in range(k // g):
        r[i * g:(i + 1) * g] *= 10.0 ** (-20 + 40 * i / max(1, k // g - 1))
    rows.append(r)
    # ties: amax = 32767 * 2^-10 in every group, so sx = 2^-10 exactly and x / sx = j + 0.5
    ties = (torch.arange(k, dtype=torch.float32) % g - g / 2 + 0.5) * 2.0**-10
    ties[::g] = 32767 * 2.0**-10
    rows.append(ties)
    return torch.stack(rows)


def int16_gemv_bound(x: torch.Tensor, w: torch.Tensor, minimum: torch.Tensor, g: int) -> torch.Tensor:
    """The int16 GEMV's documented error bound (``csrc/quant_cpu.cpp``'s header) for x ``[M, K]``,
    the dequantized ``w`` ``[N, K]`` and the group mins ``[N, K/g]``, in float64 ``[M, N]``:
    ``sum_j |scale q_j| (amax_g / 65534 (1 + 2^-7) + 2^-134)`` (the int16 rounding; ``|scale q| <=
    |w| + |min|``) plus ``2 K 2^-24 sum_j (|scale q_j| + |min_g|) |x_j|`` (float32 rounding) plus
    ``K 2^-149`` (subnormal products)."""
    M, K = x.shape
    xd = x.double()
    mins = minimum.double().repeat_interleave(g, dim=1)  # [N, K]
    a = w.double().abs() + 2 * mins.abs()
    amax = xd.abs().view(M, K // g, g).amax(-1)  # [M, K/g]
    e = (amax / 65534 * (1 + 2.0**-7) + 2.0**-134).repeat_interleave(g, dim=1)  # [M, K]
    return e @ a.T + 2 * K * 2.0**-24 * (xd.abs() @ a.T) + K * 2.0**-149


def int16_case(qtype: T, n: int, k: int, seed: int):
    """Random blocks of ``qtype`` ``[n, k]`` packed: (the PackedWeight, its part in the DIRECT
    layout, the group size, the float32 dequantized weight ``[n, k]``)."""
    data = random_blocks(qtype, n, k, seed=seed)
    wp = as_packed(qtype, data, k)
    part = wp.parts[0].direct()
    return wp, part, part.layout.group, torch.from_numpy(dequantize(data, qtype).reshape(n, k))


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_K, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_int16_gemv_error_bound(qtype):
    """The GEMV (x rounded to int16 per group) against float64 on adversarial rows, within the
    kernel's documented bound, for both layouts (Q4 G = 32, Q8 G = 32 and 16); a row holding NaN or
    Inf gives non-finite outputs and leaves the other rows alone; the scalar fallback (the no-AVX2
    build's path) computes the same bits."""
    k = 512
    wp, part, g, w = int16_case(qtype, 40, k, seed=3)
    x = adversarial_rows(k, g)
    got = wp.matmul(x[:packed.GEMV_ROWS])
    ref = x.double() @ w.double().T
    err = (got.double() - ref).abs()
    bound = int16_gemv_bound(x, w, part.minimum, g)
    assert (err <= bound).all(), (err / bound).max().item()
    assert err[0].max() > 0  # the rounding is there (a float32 GEMV of these rows errs ~100x less)
    assert torch.equal(got, quant_cpu.module().gemm_scalar(x, part.qs, part.scale, part.minimum, g, part.layout.q4))
    bad = x[:4].clone()
    bad[1, 5] = float("nan")
    bad[2, 7] = float("inf")
    bad[3, 9] = -float("inf")
    out = wp.matmul(bad)
    assert not out[1:].isfinite().any() and torch.equal(out[0], got[0])
    scalar = quant_cpu.module().gemm_scalar(bad, part.qs, part.scale, part.minimum, g, part.layout.q4)
    assert torch.equal(out.isnan(), scalar.isnan()) and torch.equal(out[~out.isnan()], scalar[~scalar.isnan()])


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_int16_gemv_odd_group_count_tails(qtype):
    """K of an odd number of groups (288 = 9 x 32: the last group in the even accumulator, the
    min term's scalar tail): the AVX2 path equals the scalar fallback bit for bit, each row of a
    1..16-row call equals the row alone, and the result stays within the documented bound."""
    k = 288
    wp, part, g, w = int16_case(qtype, 37, k, seed=8)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(4))
    for m in (1, 3, 5, 16):
        got = wp.matmul(x[:m])
        assert torch.equal(got, quant_cpu.module().gemm_scalar(x[:m], part.qs, part.scale, part.minimum, g,
                                                               part.layout.q4)), m
        assert all(torch.equal(got[i], wp.matmul(x[i:i + 1])[0]) for i in range(m)), m
        assert ((got.double() - x[:m].double() @ w.double().T).abs() <= int16_gemv_bound(x[:m], w, part.minimum, g)).all()


def test_int16_gemv_error_bound_is_tight_enough_to_fail():
    """The bound above is not vacuous: the same rows rounded to int8 (llama.cpp's activations,
    amax / 127) exceed it (checked on the float64 model of the rounding)."""
    n, k, g = 40, 512, 32
    data = random_blocks(T.Q4_1, n, k, seed=3)
    part = as_packed(T.Q4_1, data, k).parts[0].direct()
    w = torch.from_numpy(dequantize(data, T.Q4_1).reshape(n, k)).double()
    x = adversarial_rows(k, g)[:1].double()
    sx = x.abs().view(1, -1, g).amax(-1, keepdim=True) / 127
    x8 = (torch.round(x.view(1, -1, g) / sx) * sx).view(1, k)
    assert ((x8 @ w.T - x @ w.T).abs() > int16_gemv_bound(x.float(), w, part.minimum, g)).any()


def test_gemm_path_is_the_dense_linear():
    """Above GEMV_ROWS the product is F.linear of the dequantized weight, bit for bit."""
    n, k = 48, 256
    data = random_blocks(T.Q4_K, n, k)
    w = as_packed(T.Q4_K, data, k)
    x = torch.randn(packed.GEMV_ROWS + 5, k)
    dense = torch.from_numpy(dequantize(data, T.Q4_K).reshape(n, k))
    assert torch.equal(w.matmul(x), torch.nn.functional.linear(x, dense))


def test_gemm_path_chunks_bounded_scratch(monkeypatch):
    """A part wider than one dequantization chunk: each chunk's product is written by the GEMM into
    its columns of the output, the bits of ``F.linear`` of that chunk of the dequantized weight;
    the scratch buffer (one per thread, reused) holds one chunk, made once at
    DEQUANT_CHUNK_BYTES, never regrown."""
    import threading

    n, k = 200, 256
    monkeypatch.setattr(packed, "DEQUANT_CHUNK_BYTES", 64 * 4 * k)  # 64 rows a chunk: 4 chunks
    data = random_blocks(T.Q4_1, n, k)
    w = as_packed(T.Q4_1, data, k)
    dense = torch.from_numpy(dequantize(data, T.Q4_1).reshape(n, k))
    seen = {}

    small = as_packed(T.Q4_1, random_blocks(T.Q4_1, 24, k, 1), k)  # one chunk, smaller than the buffer

    def run() -> None:  # a fresh thread: a fresh scratch buffer
        small.matmul(torch.randn(packed.GEMV_ROWS + 1, k))
        seen["sizes"] = {packed._scratch.buf.numel()}
        for m in (packed.GEMV_ROWS + 1, 40, 3 * packed.GEMV_ROWS):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            ref = torch.cat([torch.nn.functional.linear(x, dense[lo:lo + 64]) for lo in range(0, n, 64)], dim=1)
            seen[m] = torch.equal(w.matmul(x), ref)
            seen.setdefault("sizes", set()).add(packed._scratch.buf.numel())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen.pop("sizes") == {packed.DEQUANT_CHUNK_BYTES // 4}
    assert all(seen.values()) and len(seen) == 3


def test_mixed_parts_and_embedding():
    """A fused weight of two types (Q4_K rows over Q6_K rows) and row lookups."""
    k = 256
    a, b = random_blocks(T.Q4_K, 16, k, 1), random_blocks(T.Q6_K, 8, k, 2)
    w = PackedWeight.from_repacked([(repack(T.Q4_K, a, k), "Q4_K"), (repack(T.Q6_K, b, k), "Q6_K")], k)
    assert w.shape == (24, k) and len(w.parts) == 2 and w.types == ("Q4_K", "Q6_K")
    dense = torch.from_numpy(np.concatenate([dequantize(a, T.Q4_K), dequantize(b, T.Q6_K)]).reshape(24, k))
    x = torch.randn(2, k)
    ref = x.double() @ dense.double().T
    assert ((w.matmul(x).double() - ref).abs().max() / ref.abs().max()).item() <= REL_TOL
    ids = torch.tensor([3, 20, 3])
    assert torch.equal(w.embedding(ids, torch.float32), dense[ids])
    single = as_packed(T.Q4_K, a, k)
    assert torch.equal(single.embedding(ids[[0, 2]], torch.float32), dense[[3, 3]])


@pytest.mark.parametrize("qtype", list(PACKED_TYPES), ids=lambda t: t.name)
def test_float16_scales_give_the_same_bits(qtype):
    """narrow_scales (the CPU loader stores scales and mins so where exact): float16 for the types
    whose scale and min are the file's fp16 values, float32 kept for the K-quants' products; and
    the GEMV, the GEMM path, the dequantization and row lookups give the float32 layout's bits."""
    exact = qtype in (T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0)
    n, k = 40, 576 if exact else 512  # 18 groups a row: the kernels' widening has a tail
    data = random_blocks(qtype, n, k)
    wide = repack(qtype, data, k)
    narrow = narrow_scales(wide)
    assert narrow.scale.dtype == narrow.minimum.dtype == (np.float16 if exact else np.float32)
    assert narrow.qs is wide.qs
    a, b = (PackedWeight.from_repacked([(r, qtype.name)], k) for r in (wide, narrow))
    assert b.nbytes == a.nbytes - (n * k // wide.layout.group * 4 if exact else 0)
    for rows in (1, 3, 5, packed.GEMV_ROWS, packed.GEMV_ROWS + 7):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(a.matmul(x), b.matmul(x))
    assert torch.equal(a.dequantize(), b.dequantize())
    ids = torch.tensor([0, 7, 7, n - 1])
    assert torch.equal(a.embedding(ids, torch.float32), b.embedding(ids, torch.float32))


def test_narrow_scales_only_where_exact():
    """float16 only if every scale and min round-trips, signs of zero included."""
    q = np.zeros((1, 32), np.uint8)
    f32 = lambda *v: np.array([v], np.float32)  # noqa: E731
    assert narrow_scales(Repacked(Q4, q, f32(0.5, 2.0**-20), f32(-0.0, 3.0))).scale.dtype == np.float16
    for scale, minimum in ((f32(0.1), f32(0.0)),  # 0.1 is not a float16
                           (f32(1.0), f32(-8 * 10000.0)),  # Q4_0's -8 d past float16's range
                           (f32(2.0**-30), f32(0.0))):  # below float16's subnormals: would become 0
        rep = Repacked(Q4, q, scale, minimum)
        assert narrow_scales(rep) is rep
    narrow = narrow_scales(Repacked(Q4, q, f32(-0.0, 1.0), f32(-0.0, -0.0)))
    assert np.signbit(narrow.scale[0, 0]) and np.signbit(narrow.minimum).all()


def test_quantized_by_gguf_py():
    """Tensors quantized by gguf-py itself (the types it can quantize) round-trip through the layout."""
    k = 256
    x = np.random.default_rng(3).standard_normal((8, k)).astype(np.float32)
    for qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0):
        data = quantize(x, qtype)
        ref = dequantize(data, qtype).reshape(8, k)
        assert np.array_equal(as_packed(qtype, data, k).dequantize().numpy(), ref)


def test_tiny_gguf_forward_packed_equals_dequant(tmp_path):
    """A tiny Q4_0 llama GGUF (untied head, packed too): the packed model's logits are the dequant
    model's within float32 error, for prefill chunks above GEMV_ROWS (the GEMM path) and 3-row
    steps (the GEMV); the logits rows always go through the GEMV.

    The GEMV rounds x to int16 per group (``csrc/quant_cpu.cpp``): each product moves by up to
    ``sum |scale q| amax / 65534`` (~1.5e-5 of a group's magnitude), compounded over the layers;
    measured 2.0e-5 at most on these logits (float32 products alone: ~1e-6), so the bound is
    5e-5 (it was 1e-5 with the float GEMV)."""
    from test_models_tiny import make_hf, our_logits, write_gguf

    from monobatch.loader import gguf_file

    write_gguf(make_hf("llama", tmp_path / "hf"), tmp_path / "m.gguf", T.Q4_0)
    cpu = torch.device("cpu")
    models = {w: gguf_file.load_gguf_model(gguf_file.open_gguf(tmp_path / "m.gguf"), cpu, torch.float32,
                                           progress=False, weights=w) for w in ("packed", "dequant")}
    assert models["packed"].lm_head.packed and not models["dequant"].lm_head.packed
    ids = list(range(3, 3 + 2 * (packed.GEMV_ROWS + 4)))
    for prompt in (ids, ids[:6]):
        torch.testing.assert_close(our_logits(models["packed"], prompt), our_logits(models["dequant"], prompt),
                                   atol=PACKED_TINY_ATOL, rtol=1e-5)


#: The tiny GGUF model's packed-vs-dequant logits bound (test_tiny_gguf_forward_packed_equals_dequant).
PACKED_TINY_ATOL = 5e-5


@pytest.mark.slow
def test_bundled_model_tensors():
    """The bundled GGUF's real Q4_1 (FFN) and Q8_0 (embedding) tensors."""
    from monobatch.loader import bundled_model_path
    from monobatch.loader.gguf_file import open_gguf

    path = bundled_model_path()
    if path is None:
        pytest.skip("bundled model not installed")
    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    for name, rows in (("blk.0.ffn_down.weight", 576), ("token_embd.weight", 512)):
        t = tensors[name]
        qtype, k = T(int(t.tensor_type)), int(t.shape[0])
        data = np.asarray(t.data[:rows])
        w = as_packed(qtype, data, k)
        ref = dequantize(data, qtype).reshape(rows, k)
        assert np.array_equal(w.dequantize().numpy(), ref)
        x = torch.randn(1, k)
        exp = x.double() @ torch.from_numpy(ref).double().T
        assert ((w.matmul(x).double() - exp).abs().max() / exp.abs().max()).item() <= 4 * k * 2.0**-24


#: A packed/dequant divergence is allowed only where the dequant path's top-2 logits are this close:
#: the packed GEMV's int16 activations move a logit by up to helpers.PACKED_LOGIT_TOL (it was 1e-3
#: with the float GEMV, whose products in another order moved a logit by ~1e-5).
NEAR_TIE = PACKED_NEAR_TIE


@pytest.mark.slow
@pytest.mark.usefixtures("one_cpu_thread_in_test")
def test_bundled_greedy_packed_equals_dequant(loaded, dequantized, make_scheduler):
    """The oracle tests' held-in prompts: greedy tokens of the packed model (the session default)
    equal the dequantized model's, or diverge only at a logged near-tie."""
    import logging

    from helpers import first_divergence, run_requests
    from test_oracle import ALL, N_TOKENS, prompt_ids

    from monobatch.engine.engine import Engine
    from monobatch.engine.params import SamplingParams
    from monobatch.engine.scheduler import BatchScheduler

    assert loaded.weights == "packed"
    dequant = dequantized
    assert dequant.weights == "dequant" and dequant.weight_bytes > 4 * loaded.weight_bytes
    sp = SamplingParams(max_tokens=min(N_TOKENS, 32), temperature=0.0, ignore_eos=True)
    prompts = [prompt_ids(loaded.tokenizer, text, chat) for text, chat in ALL]
    ours = run_requests(make_scheduler(), prompts, sp)
    ref = run_requests(BatchScheduler(Engine(dequant)), prompts, sp)
    engine = Engine(dequant)
    for ids, a, b in zip(prompts, ours, ref):
        i = first_divergence(a, b)
        if i is not None:
            margin = engine.top2_margin(ids + b[:i])
            logging.getLogger(__name__).warning("packed vs dequant: diverged at %d (%d vs %d), margin %.2e", i, a[i], b[i], margin)
            assert margin < NEAR_TIE


def test_kernels_refuse_scales_that_do_not_match_the_rows():
    """The CPU kernels take N from the packed bytes: scales of fewer rows (or not 2-D) are a
    RuntimeError before any read, not reads past their end."""
    qs = torch.zeros(64, 16, dtype=torch.uint8)
    x = torch.zeros(1, 32)
    for sc in (torch.ones(1, 1), torch.ones(64)):
        with pytest.raises(RuntimeError, match="scales"):
            quant_cpu.gemm(x, qs, sc, sc.clone(), 32, True)
        with pytest.raises(RuntimeError, match="scales"):
            quant_cpu.dequant(qs, sc, sc.clone(), 32, True, torch.empty(64, 32))
    assert quant_cpu.gemm(x, qs, torch.ones(64, 1), torch.zeros(64, 1), 32, True).shape == (1, 64)
