"""The fused CUDA kernels (kernels/fused.py) against their torch references: on CUDA in bf16
(scripts/gpu_check.sh runs these), and in Triton's CPU interpreter in fp32 where Triton is
installed (the interpreter's bf16 arithmetic is not faithful)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import run_in_triton_interpreter

from monobatch.models.layers import RMSNorm
from monobatch.models.rope import apply_rope


def _cases(dtype, device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 576, generator=g)
    w = torch.randn(576, generator=g)
    q = torch.randn(7, 9, 64, generator=g)
    angles = torch.randn(7, 32, generator=g) * 7
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    gu = torch.randn(7, 2 * 1536, generator=g)
    delta = torch.randn(7, 576, generator=g)
    qkv = torch.randn(7, (9 + 2 * 3) * 64, generator=g)  # packed projection: 9 q heads, 3 k, 3 v
    return [t.to(device, dtype) for t in (x, w, q, cos, sin, gu, delta, qkv)]


def check(dtype=torch.float32, device="cpu", tol=1e-5):
    """Every fused kernel against its reference (callable in a subprocess)."""
    from monobatch.kernels import fused
    x, w, q, cos, sin, gu, d, packed = _cases(dtype, device)
    norm = RMSNorm(576, 1e-5).to(device)
    norm.weight.data = w
    ref_norm = fused._ON
    try:
        fused._ON = False  # the torch references
        want = (norm(x), apply_rope(q, cos, sin), F.silu(gu[:, :1536]) * gu[:, 1536:],
                *norm.add_forward(x, d),
                apply_rope(packed[:, :576].view(7, 9, 64), cos, sin),
                apply_rope(packed[:, 576:768].view(7, 3, 64), cos, sin))
    finally:
        fused._ON = ref_norm
    got = (fused.rms_norm(x, w, 1e-5), fused.rope(q, cos, sin), fused.silu_mul(gu),
           *fused.add_rms_norm(x, d, w, 1e-5), *fused.rope_qk(packed, 9, 3, 64, cos, sin))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    # strided input (a view of a packed projection) and an empty batch
    qkv = torch.cat([q.flatten(1), q.flatten(1)], -1)[:, :q.numel() // 7].view(7, 9, 64)
    torch.testing.assert_close(fused.rope(qkv, cos, sin).float(), want[1].float(), rtol=tol, atol=tol)
    assert fused.rms_norm(x[:0], w, 1e-5).shape == (0, 576)
    # add_rms_norm: the new residual is torch's add bit for bit (fp32, rounded once); strided rows
    # and a leading batch shape; x is not written
    assert torch.equal(got[3], want[3])
    x0 = x.clone()
    wide = torch.cat([d, x], -1)  # rows 1152 apart
    for a, b in zip(fused.add_rms_norm(wide[:, 576:], wide[:, :576], w, 1e-5), want[3:5]):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    for a, b in zip(fused.add_rms_norm(x.view(7, 1, 576), d.view(7, 1, 576), w, 1e-5), want[3:5]):
        assert a.shape == (7, 1, 576)
        torch.testing.assert_close(a.view(7, 576).float(), b.float(), rtol=tol, atol=tol)
    assert torch.equal(x, x0)
    assert [t.shape for t in fused.add_rms_norm(x[:0], d[:0], w, 1e-5)] == [(0, 576), (0, 576)]
    # rope_qk: contiguous q and k; from a strided projection (rows of a wider buffer); empty
    assert got[5].is_contiguous() and got[6].is_contiguous()
    for a, b in zip(fused.rope_qk(torch.cat([packed, packed], -1)[:, :packed.shape[1]], 9, 3, 64, cos, sin), want[5:]):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    assert [t.shape for t in fused.rope_qk(packed[:0], 9, 3, 64, cos[:0], sin[:0])] == [(0, 9, 64), (0, 3, 64)]
    # cos/sin as RotaryEmbedding's table gives them: two views of one (T, 2, hd) gather, read in place
    pair = torch.stack((cos, sin), dim=1)
    tc, ts = pair[:, 0], pair[:, 1]
    assert fused._rows_contiguous(tc, ts)[0].data_ptr() == tc.data_ptr()
    assert torch.equal(fused.rope(q, tc, ts), got[1])
    for a, b in zip(fused.rope_qk(packed, 9, 3, 64, tc, ts), got[5:]):
        assert torch.equal(a, b)
    # rope_qk with store: k and v written straight into a pool at each row's slot, bit for bit
    # what store_kv of the returned k and of v (packed's last 3 heads) writes; other slots untouched
    from monobatch.kernels.paged_decode import store_kv
    slots = torch.tensor([5, 0, 9, 2, 11, 7, 3], device=device)
    pools = [torch.full((12, 3, 64), 7.0, dtype=dtype, device=device) for _ in range(4)]
    store_kv(got[6], packed[:, 12 * 64:].reshape(7, 3, 64), pools[0], pools[1], slots)
    q_only, none = fused.rope_qk(packed, 9, 3, 64, cos, sin, (pools[2], pools[3], slots))
    assert none is None and torch.equal(q_only, got[5])
    assert torch.equal(pools[2], pools[0]) and torch.equal(pools[3], pools[1])
    # ... from a strided projection too (v read through the row stride), and a misfit is refused
    pools[2].fill_(7.0), pools[3].fill_(7.0)
    fused.rope_qk(torch.cat([packed, packed], -1)[:, :packed.shape[1]], 9, 3, 64, cos, sin, (pools[2], pools[3], slots))
    assert torch.equal(pools[2], pools[0]) and torch.equal(pools[3], pools[1])
    with pytest.raises(ValueError, match="do not fit"):
        fused.rope_qk(packed, 9, 3, 64, cos, sin, (pools[2], pools[3][:, :2], slots))
    return "ok"


def test_fused_kernels_in_interpreter():
    run_in_triton_interpreter("test_kernels", "check")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_fused_kernels_on_cuda():
    from monobatch.kernels.paged_decode import triton
    if triton is None:
        pytest.skip("Triton not installed")
    check(torch.float32, "cuda", 1e-5)
    check(torch.bfloat16, "cuda", 3e-2)


def test_fused_path_is_cuda_only():
    from monobatch.kernels import fused
    assert not fused.enabled(torch.zeros(2))
