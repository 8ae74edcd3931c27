"""The batch-invariant GEMM (kernels/invariant_gemm.py): its product against torch's, in Triton's
CPU interpreter and on CUDA; on CUDA, every row's bits whatever the row count and tile (the
property ``--deterministic`` needs; scripts/check_gemm_invariance.py runs the full shape sweep)."""

from __future__ import annotations

import pytest
import torch

from helpers import run_in_triton_interpreter


def check(device: str = "cpu") -> str:
    """Every tile of TILES, split-K on and off, with and without bias, float32 and (CUDA)
    bfloat16 with float32 output, odd M/N/K (K over two SLICE_Ks and a part, so the split has
    three slices, the last one short); then, on CUDA, the rows of every M, tile and split equal
    the rows of the largest M."""
    from monobatch.kernels import invariant_gemm
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    for dtype in dtypes:
        k = 2 * invariant_gemm.SLICE_K + 100
        x = torch.randn(70, k, generator=g).to(device, dtype)
        w = (torch.randn(90, k, generator=g) * 0.05).to(device, dtype)
        b = torch.randn(90, generator=g).to(device, dtype)
        ref = (x.double() @ w.double().T + b.double())
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        for cfg in invariant_gemm.TILES:
            for split in (False, True):
                for bias in (None, b):
                    y = invariant_gemm.linear(x, w, bias, out_dtype=torch.float32, config=tuple(cfg), split=split)
                    want = ref if bias is not None else ref - b.double()
                    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
        if device == "cuda":
            full = invariant_gemm.linear(x, w, b)
            assert torch.equal(invariant_gemm.linear(x, w, b, split=False), full)
            for m in (1, 2, 5, 16, 17, 33, 64, 65):
                for cfg in invariant_gemm.TILES:
                    for split in (False, True):
                        got = invariant_gemm.linear(x[:m], w, b, config=tuple(cfg), split=split)
                        assert torch.equal(got, full[:m]), (m, cfg, split)
    return "ok"


def test_invariant_gemm_in_interpreter():
    run_in_triton_interpreter("test_invariant_gemm", "check")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_invariant_gemm_cuda():
    assert check("cuda") == "ok"
