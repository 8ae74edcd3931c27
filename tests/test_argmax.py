"""The Triton greedy argmax (:mod:`monobatch.kernels.argmax`) against torch.argmax, bit for bit:
in Triton's CPU interpreter (skipped where Triton is not installed) on one- and many-chunk rows
with ties, NaN, +-inf and signed zeros; on CUDA on bf16-derived logits of real vocabulary sizes
(many ties), run to run and in a replayed CUDA graph; torch's argmax wherever the kernel is off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import run_in_triton_interpreter
from monobatch.kernels import common

ROOT = Path(__file__).resolve().parents[1]
NAN, INF = float("nan"), float("inf")


def _cases(V: int, g: torch.Generator) -> torch.Tensor:
    """Rows of width V (> 1000) exercising the tie and NaN rules across and within chunks."""
    rows = [torch.randn(V, generator=g) for _ in range(11)]
    rows[0][[V - 3, 700, 300, V // 2]] = 9.0  # ties within the first chunk and in later ones
    rows[1][[V - 1, V - 2]] = 9.0  # a tie in the last (partial) chunk only
    rows[2][[10]], rows[2][[V - 5, V // 2]] = INF, NAN  # the first NaN wins over an earlier +inf
    rows[3][[V - 1]] = NAN  # a NaN in the last column only
    rows[4][[V // 3, 5, V - 7]] = INF  # +inf: the first one
    rows[5].fill_(-INF)  # all -inf: index 0
    rows[6].fill_(-INF)
    rows[6][V - 2] = -1e30  # one finite value, in the last chunk
    rows[7].fill_(-1.0)
    rows[7][[9, 5]] = torch.tensor([0.0, -0.0])  # -0.0 == +0.0: the first of them
    rows[8].fill_(NAN)  # all NaN: index 0
    rows[9][[3, V - 4]] = NAN  # NaN in the first and last chunks
    rows[10].fill_(7.0)  # a constant row
    return torch.stack(rows)


def check_interpreter() -> str:
    """Every path on CPU tensors (callable in a TRITON_INTERPRET=1 subprocess): one chunk (V =
    1000) and several (V = 5003: 5 chunks, a masked tail; V = 49152: 24), R = 0, 1, 3 and the
    special rows of :func:`_cases`, padded rows (row stride > V), repeat calls (the counters are
    left zeroed, same result); other dtypes go to torch."""
    from monobatch.kernels.argmax import argmax
    g = torch.Generator().manual_seed(0)
    for V in (1000, 5003, 49152):
        for x in (torch.randn(1, V, generator=g), torch.randn(3, V, generator=g), _cases(V, g),
                  torch.randn(3, V + 24, generator=g)[:, :V]):
            got = argmax(x)
            assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1)), (V, got, x.argmax(dim=-1))
            assert torch.equal(argmax(x), got)
            counters = common.COUNTERS.get(torch.device("cpu"))
            assert counters is None or int(counters.abs().sum()) == 0
    assert torch.device("cpu") in common.COUNTERS  # the split path ran (not torch's argmax)
    assert argmax(torch.empty(0, 5003)).shape == (0,)
    xb = torch.randn(2, 3000, generator=g).bfloat16()
    assert torch.equal(argmax(xb), xb.argmax(dim=-1))
    return "ok"


def test_argmax_in_interpreter():
    run_in_triton_interpreter("test_argmax", "check_interpreter")


def test_chunking():
    """Power-of-two chunks of 1024..4096 columns, at most 32 of them up to 131072 columns."""
    from monobatch.kernels.argmax import _block
    for V in (1, 1000, 1024, 5003, 32000, 49152, 128256, 131072, 151936, 262144):
        b = _block(V)
        assert b & (b - 1) == 0 and 1024 <= b <= 4096 and (-(-V // b) <= 32 or b == 4096)


def test_falls_back_to_torch_off_cuda():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs the kernel on CPU tensors")
    from monobatch.kernels.argmax import argmax
    g = torch.Generator().manual_seed(0)
    for x in (_cases(5003, g), torch.randn(2, 49152, generator=g), torch.randn(3, 100, generator=g).half()):
        assert torch.equal(argmax(x), x.argmax(dim=-1))


def test_env_var_switches_it_off():
    code = "from monobatch.kernels import argmax; print(argmax._ON)"
    done = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'src')!r}); {code}"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "MONOBATCH_TRITON_ARGMAX": "0"})
    assert done.stdout.strip() == "False", done.stderr[-2000:]


def _cuda_argmax():
    if not torch.cuda.is_available():
        pytest.skip("CUDA only")
    from monobatch.kernels import argmax as A
    if A.triton is None:
        pytest.skip("Triton not installed")
    return A


@pytest.mark.parametrize("V", [1000, 32000, 49152, 128256, 151936])
def test_matches_torch_on_cuda(V):
    """bf16-derived float32 logits (ties are common), R = 1..16, and the special rows: the bits
    of torch.argmax, on every run and in a CUDA graph (captured before and after the counters
    exist)."""
    A = _cuda_argmax()
    g = torch.Generator(device="cuda").manual_seed(V)
    for R in (1, 2, 5, 16):
        x = (torch.randn(R, V, generator=g, device="cuda") * 4).bfloat16().float()
        assert torch.equal(A.argmax(x), x.argmax(dim=-1))
    if V > 1000:
        x = _cases(V, torch.Generator().manual_seed(1)).cuda()
        assert all(torch.equal(A.argmax(x), x.argmax(dim=-1)) for _ in range(3))
    for drop_counters in (False, True):
        saved = common.COUNTERS.pop(x.device, None) if drop_counters else None
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = A.argmax(x)
            for _ in range(3):  # new logits in the captured input each replay
                x.copy_(x.roll(7, dims=-1))
                out.zero_()
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, x.argmax(dim=-1))
        finally:
            if saved is not None:
                common.COUNTERS[x.device] = saved
    counters = common.COUNTERS.get(x.device)
    assert counters is None or int(counters.abs().sum()) == 0
