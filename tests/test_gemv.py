"""The Triton skinny GEMM (:mod:`monobatch.kernels.gemv`) against F.linear: in Triton's CPU
interpreter on small fp32/fp16 cases (the interpreter's bf16 arithmetic is not faithful; it is
skipped where Triton is not installed), on CUDA in bf16 for the decode shapes of llama-1b,
smollm2-135m and llama-8b (with split-K, CUDA-graph replay and run-to-run bits), and the
F.linear fallback wherever the kernel is not usable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import run_in_triton_interpreter
from monobatch.kernels import common

ROOT = Path(__file__).resolve().parents[1]
# (N, K) of the decode linears: qkv, o, gate_up, down, lm_head
MODEL_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (49152, 2048),
                (960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576),
                (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, DOT); None: the table / heuristic
SMALL_CONFIGS = [None, (16, 32, 1, 4, 2, False), (8, 32, 3, 4, 1, False), (16, 32, 1, 4, 2, True),
                 (16, 32, 2, 4, 3, True)]


def check_interpreter() -> str:
    """Every path of the kernel on small shapes (callable in a TRITON_INTERPRET=1 subprocess):
    FMA and DOT, split-K (identical bits run to run, counters left zeroed), N and K not multiples
    of the blocks (K = 100: masked tail), bias, fp16 inputs with fp16 / fp32 output."""
    from monobatch.kernels import gemv as G
    g = torch.Generator().manual_seed(0)
    for N, K in ((64, 96), (40, 100)):
        w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
        for M in (1, 2, 3, 16):
            x = torch.randn(M, K, generator=g)
            for i, cfg in enumerate(SMALL_CONFIGS):
                bias = b if (i + M) % 2 else None
                if cfg is not None and not cfg[5] and M > 4:
                    with pytest.raises(ValueError):
                        G.gemv(x, w, bias, config=cfg)
                    continue
                got = G.gemv(x, w, bias, config=cfg)
                assert got.dtype == torch.float32 and got.shape == (M, N)
                torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
                if cfg is not None and cfg[2] > 1:
                    assert torch.equal(got, G.gemv(x, w, bias, config=cfg))
        x16, w16, b16 = x[:3].half(), w.half(), b.half()
        want = F.linear(x16.float(), w16.float(), b16.float())
        for cfg in SMALL_CONFIGS:
            got = G.gemv(x16, w16, b16, out_dtype=torch.float32, config=cfg)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(G.gemv(x16, w16, b16, config=cfg), want.half(), rtol=2e-3, atol=2e-3)
    # gated input (SwiGLU's down projection): the SiLU computed on load = fused.silu_mul, then the product
    from monobatch.kernels.fused import silu_mul
    for M, K, dtype in ((3, 96, torch.float32), (1, 100, torch.float32), (2, 100, torch.float16), (16, 96, torch.float32)):
        wide = (torch.randn(M, 2 * K + 8, generator=g) * 3).to(dtype)
        gu, w2, b2 = wide[:, 4:4 + 2 * K], torch.randn(40, K, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
        for cfg in SMALL_CONFIGS:  # strided rows, the K tail masked (K = 100), bias
            if cfg is not None and not cfg[5] and M > 4:
                continue
            assert torch.equal(G.gemv(gu, w2, b2, config=cfg, gated=True), G.gemv(silu_mul(gu), w2, b2, config=cfg))
    with pytest.raises(ValueError):
        G.gemv(wide[:, :2 * K + 1], w2, gated=True)
    assert int(common.COUNTERS[torch.device("cpu")].abs().sum()) == 0
    assert G.gemv(x[:0], w).shape == (0, N)
    return "ok"


def test_gemv_in_interpreter():
    run_in_triton_interpreter("test_gemv", "check_interpreter")


def test_configs_are_fixed_and_valid():
    """The config is a pure function of (N, K, M bucket, dtype), legal for the kernel, and the
    K slices cover K exactly with whole blocks."""
    from monobatch.kernels import gemv as G
    assert all(key in G.CONFIGS for key in G.PDL_CONFIGS)  # an override of a measured row
    cases = [(N, K, M, p) for N, K in MODEL_SHAPES + [(64, 96), (40, 100)] for M in range(1, G.MAX_M + 1)
             for p in (False, True)]
    for N, K, M, with_pdl in cases:
        cfg = G.choose(N, K, M, torch.bfloat16, with_pdl)
        assert cfg == G.choose(N, K, 1 << (M - 1).bit_length(), torch.bfloat16, with_pdl)
        assert G.choose(N, K, M, torch.float16, with_pdl) == cfg
        if cfg is None:  # the table says cuBLAS
            continue
        bn, bk, splits, warps, stages, dot = cfg
        assert bn & (bn - 1) == 0 and bk & (bk - 1) == 0 and bk >= 16 and splits >= 1
        assert warps in (1, 2, 4, 8, 16) and stages >= 1 and (bn >= 16 if dot else M <= 4)
        k_per, n = G.slices(K, bk, splits)
        assert k_per % bk == 0 and 1 <= n <= splits and (n - 1) * k_per < K <= n * k_per


def test_linear_falls_back_off_cuda():
    from monobatch.kernels import gemv as G
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(32, generator=g)
    assert not G.usable(x, w)
    assert torch.equal(G.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(G.linear(x.view(3, 1, 64), w), F.linear(x, w).view(3, 1, 32))
    xb, wb = x.bfloat16(), w.bfloat16()
    y = G.linear(xb, wb, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and torch.equal(y, F.linear(xb, wb).float())
    gu = torch.randn(2, 3, 128, generator=g)  # gated: torch's silu(gate) * up, then the product
    assert torch.equal(G.gated_linear(gu, w, b), F.linear(F.silu(gu[..., :64]) * gu[..., 64:], w, b))
    with pytest.raises(ValueError):
        G.gated_linear(gu[..., :127], w)


def test_env_var_switches_it_off():
    code = "from monobatch.kernels import gemv; print(gemv._ON)"
    done = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'src')!r}); {code}"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "MONOBATCH_TRITON_GEMV": "0"})
    assert done.stdout.strip() == "False", done.stderr[-2000:]


def _cuda_gemv():
    if not torch.cuda.is_available():
        pytest.skip("CUDA only")
    from monobatch.kernels import gemv as G
    if G.triton is None:
        pytest.skip("Triton not installed")
    return G


def _rel_err(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.float() - exact).abs().max() / exact.abs().max()).item()


@pytest.mark.parametrize("N,K", MODEL_SHAPES)
def test_model_shapes_on_cuda(N, K):
    """bf16, M = 1..16: the chosen config (gemv) and the dispatcher (linear) within bf16 rounding
    of the fp32 product; float32 output (LM heads) within fp32 summation error."""
    G = _cuda_gemv()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(N, K, generator=g, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, generator=g, device="cuda", dtype=torch.bfloat16)
    wt = w.double().t()
    for M in (1, 2, 3, 8, 13, 16):
        x = torch.randn(M, K, generator=g, device="cuda", dtype=torch.bfloat16)
        assert G.usable(x, w)
        exact = (x.double() @ wt).float()
        assert _rel_err(G.gemv(x, w), exact) < 1e-2
        assert _rel_err(G.linear(x, w), exact) < 1e-2
        assert _rel_err(G.gemv(x, w, b), exact + b.float()) < 1e-2
        y32 = G.gemv(x, w, out_dtype=torch.float32)
        assert y32.dtype == torch.float32 and _rel_err(y32, exact) < 1e-4
        assert G.linear(x, w, out_dtype=torch.float32).dtype == torch.float32
    assert not G.usable(torch.zeros(G.MAX_M + 1, K, device="cuda", dtype=torch.bfloat16), w)


@pytest.mark.parametrize("N,K", [(2048, 8192), (576, 1536), (4096, 14336)])
def test_gated_down_projection_on_cuda(N, K):
    """gated_linear (the SiLU inside the down GEMV) gives the bits of fused.silu_mul followed by
    linear, at every decode batch size (whichever kernel the table picks)."""
    G = _cuda_gemv()
    from monobatch.kernels.fused import silu_mul
    g = torch.Generator(device="cuda").manual_seed(2)
    w = torch.randn(N, K, generator=g, device="cuda", dtype=torch.bfloat16)
    for M in (1, 2, 3, 8, 16, 17):
        gu = torch.randn(M, 2 * K, generator=g, device="cuda", dtype=torch.bfloat16) * 3
        assert torch.equal(G.gated_linear(gu, w), G.linear(silu_mul(gu), w))


@pytest.mark.parametrize("cfg", [(16, 512, 1, 4, 3, False), (8, 256, 4, 4, 1, False), (4, 1024, 2, 8, 3, False),
                                 (32, 256, 1, 4, 3, True), (64, 128, 8, 4, 4, True), (16, 512, 3, 4, 3, True)])
def test_configs_on_cuda_are_exact_and_repeatable(cfg):
    """Forced configs (split-K included) on llama-1b's o_proj, M = 1, 5, 16: right, and the same
    bits on every run and in a replayed CUDA graph (captured before and after the split-K
    counters exist)."""
    G = _cuda_gemv()
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(2048, 2048, generator=g, device="cuda", dtype=torch.bfloat16)
    for M in (1, 5, 16):
        if not cfg[5] and M > 4:
            continue
        x = torch.randn(M, 2048, generator=g, device="cuda", dtype=torch.bfloat16)
        y = G.gemv(x, w, config=cfg)
        assert _rel_err(y, (x.double() @ w.double().t()).float()) < 1e-2
        assert all(torch.equal(y, G.gemv(x, w, config=cfg)) for _ in range(3))
        for drop_counters in (False, True):
            saved = common.COUNTERS.pop(x.device, None) if drop_counters else None
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = G.gemv(x, w, config=cfg)
                for _ in range(3):
                    out.zero_()
                    graph.replay()
                    torch.cuda.synchronize()
                    assert torch.equal(out, y)
            finally:
                if saved is not None:
                    common.COUNTERS[x.device] = saved
