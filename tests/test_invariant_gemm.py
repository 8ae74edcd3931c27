"""The batch-invariant GEMM (kernels/invariant_gemm.py): its product against torch's, in Triton's
CPU interpreter and on CUDA; on CUDA, every row's bits whatever the row count and tile (the
property ``--deterministic`` needs; scripts/check_gemm_invariance.py runs the full shape sweep)."""

from __future__ import annotations

import pytest
import torch

from helpers import run_in_triton_interpreter


def check(device: str = "cpu") -> str:
    """Every tile of TILES, split-K on and off (unsplit: the K steps in one loop and nested per
    slice), with and without bias, float32 and (CUDA)
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
            for split, flat in ((False, False), (False, True), (True, False)):
                for bias in (None, b):
                    y = invariant_gemm.linear(x, w, bias, out_dtype=torch.float32, config=tuple(cfg), split=split,
                                              flat=flat)
                    want = ref if bias is not None else ref - b.double()
                    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
        if device == "cuda":
            full = invariant_gemm.linear(x, w, b)
            assert torch.equal(invariant_gemm.linear(x, w, b, split=False), full)
            for m in (1, 2, 5, 16, 17, 33, 64, 65):
                for cfg in invariant_gemm.TILES:
                    for split, flat in ((False, False), (False, True), (True, False)):
                        got = invariant_gemm.linear(x[:m], w, b, config=tuple(cfg), split=split, flat=flat)
                        assert torch.equal(got, full[:m]), (m, cfg, split, flat)
    return "ok"


def test_invariant_gemm_in_interpreter():
    run_in_triton_interpreter("test_invariant_gemm", "check")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_invariant_gemm_cuda():
    assert check("cuda") == "ok"


def test_tile_and_split_rules():
    """config_for picks only TILES (the ones checked bitwise on the GPU), every BLOCK_K below and
    dividing SLICE_K; split_for splits decode rows of narrow outputs and outputs with few tiles,
    never a K of one slice, never a large prompt."""
    from monobatch.kernels import invariant_gemm as ig
    cpu = torch.device("cpu")  # sm_count: 16 off CUDA
    for m in (1, 7, 16, 17, 64, 65, 256, 512, 513, 4096):
        for n in (576, 2048, 4096, 4097, 8192, 8193, 49152, 262144):
            cfg = ig.config_for(m, n)
            assert cfg in ig.TILES, (m, n, cfg)
            assert ig.SLICE_K % cfg[2] == 0 and cfg[2] < ig.SLICE_K
    assert ig.config_for(1, 2048) == ig.TILES[0] and ig.config_for(1, 49152) == ig.TILES[1]
    assert ig.config_for(64, 49152) == ig.TILES[2] and ig.config_for(256, 16384) == ig.TILES[3]
    assert ig.split_for(1, 2048, 2048, ig.config_for(1, 2048), cpu)
    assert not ig.split_for(1, 2048, ig.SLICE_K, ig.config_for(1, 2048), cpu)  # one slice: nothing to split
    assert not ig.split_for(1, 16384, 2048, ig.config_for(1, 16384), cpu)  # wide: enough programs unsplit
    assert ig.split_for(64, 64, 2048, ig.config_for(64, 64), cpu)  # one tile for 16 SMs
    assert not ig.split_for(4096, 2048, 8192, ig.config_for(4096, 2048), cpu)


@pytest.mark.skipif(__import__("monobatch.kernels.common", fromlist=["triton"]).triton is None, reason="needs Triton")
def test_a_one_step_slice_is_refused():
    """BLOCK_K = SLICE_K makes each slice one tl.dot, which Triton folds into the running total
    (another order: the H200 check found that tile's rows off) — refused before any launch."""
    from monobatch.kernels import invariant_gemm as ig
    x, w = torch.zeros(2, 2 * ig.SLICE_K), torch.zeros(3, 2 * ig.SLICE_K)
    with pytest.raises(ValueError, match="SLICE_K"):
        ig.linear(x, w, config=(16, 16, ig.SLICE_K, 4, 2))
    with pytest.raises(ValueError, match="SLICE_K"):
        ig.linear(x, w, config=(16, 16, 96, 4, 2))


def check_glu(device: str = "cpu") -> str:
    """glu_linear (deterministic decode rows: the gate/up product and SiLU in one launch) has the
    bits of fused.silu_mul of the plain product (compared as 16-/32-bit integers: a zero's sign
    too), for every M it takes, K of one slice and of several (the last one short); on CUDA also
    llama-1b's and llama-8b's gate/up (K 2,048 and 4,096, F 8,192 and 14,336: the tile the model
    runs) and an F off the tile. None where it does not apply (more than 16 rows, a bias, outside
    mode(True), GLU off)."""
    from monobatch.kernels import fused, invariant_gemm as ig
    g = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    # F a multiple of the 16-row tiles' BN (32) in the interpreter: its numpy matmul may give a
    # column other bits at another place in a tile or beside other columns (the GPU's MMA does
    # not, see check()); so there each gate and up column sits where it sits in the [M, 2F] product
    cases = [(2 * ig.SLICE_K + 64, 96), (ig.SLICE_K, 64), (256, 4224)]
    if device == "cuda":
        cases += [(2048, 8192), (4096, 14336), (2 * ig.SLICE_K + 64, 100)]
    before = ig.GLU
    ig.GLU = True
    try:
        for k, f in cases:
            w = (torch.randn(2 * f, k, generator=g) * 0.05).to(device, dtype)
            x = torch.randn(17, k, generator=g).to(device, dtype)
            assert ig.glu_linear(x[:1], w) is None  # not in mode(True)
            for m in (1, 2, 3, 16):
                cfg = ig.config_for(m, 2 * f)
                want = fused.silu_mul(ig.linear(x[:m], w, config=cfg, split=False))
                assert torch.equal(ig.glu_launch(x[:m], w, cfg).view(bits), want.view(bits)), (k, f, m)
                if device == "cuda":
                    with ig.mode(True):
                        got = ig.glu_linear(x[:m], w)
                        if got is None:  # a product linear would split (narrow outputs): the two launches
                            assert ig.split_for(m, 2 * f, k, cfg, x.device), (k, f, m)
                        else:
                            assert torch.equal(got.view(bits), fused.silu_mul(ig.linear(x[:m], w)).view(bits))
            with ig.mode(True):
                assert ig.glu_linear(x, w) is None and ig.glu_linear(x[:1], w, w[:, 0]) is None
                assert device == "cuda" or ig.glu_linear(x[:1], w) is None  # CUDA only
        ig.GLU = False
        with ig.mode(True):
            assert ig.glu_linear(x[:1], w) is None
    finally:
        ig.GLU = before
    return "ok"


def test_glu_linear_in_interpreter():
    run_in_triton_interpreter("test_invariant_gemm", "check_glu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_glu_linear_cuda():
    assert check_glu("cuda") == "ok"


def test_a_bad_glu_setting_warns_and_keeps_the_default():
    """MONOBATCH_DET_GLU other than 0 or 1 is named in a warning and leaves the GLU launch at its default (on)."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "from monobatch.kernels import invariant_gemm as ig; print(ig.GLU)"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "MONOBATCH_DET_GLU": "yes"})
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-500:]
    assert "MONOBATCH_DET_GLU='yes'" in done.stderr
