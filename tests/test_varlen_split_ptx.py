"""The varlen attention kernel (kernels/varlen_attention.py) compiled for sm_90, no GPU needed:
deterministic mode's two schedules (the split grid and the in-program split loop) must compile
to the same arithmetic, the module docstring's rule 3. Checked on the compiled code:

* every ``tl.dot`` of the kernel has one of two signatures (operand and result types with their
  layouts: Q K^T and P V), so both schedules run the same MMA instructions on the same tiles;
* no plain ``mul.f32`` feeds an ``add``/``sub.f32`` in the PTX: ptxas contracts such pairs into
  an FMA where it finds them, a choice that could differ between two places; the kernel's
  multiply-adds are explicit ``fma.rn`` instead;
* the PDL rule of kernels/pdl.py (nothing stored or updated before ``griddepcontrol.wait``).

Needs Triton >= 3.4 (its bundled ptxas); skips elsewhere (CI's CPU torch has no Triton), as
tests/test_pdl_ptx.py. A kernel that does not compile here would not compile on the GPU either.
"""

from __future__ import annotations

import functools
import os
import re

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter compiles nothing", allow_module_level=True)
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.language.extra.cuda import gdc_wait  # noqa: F401  (Triton >= 3.4)
except ImportError:
    pytest.skip("this Triton has no griddepcontrol helpers", allow_module_level=True)

from helpers import sm90_compile_problem  # noqa: E402
from monobatch.kernels import varlen_attention as va  # noqa: E402

_UNSPECIALIZED = {"stride_tb", "window", "rows_q"}  # the kernel's do_not_specialize


@functools.cache
def _compiled(split: bool, dtype: str, g: int, hd: int, pdl: bool):
    """The kernel for sm_90 as launched for ``n_q / n_kv = g`` (8 KV heads), head_dim ``hd``."""
    g_pad = triton.next_power_of_2(g)
    constexprs = dict(NKV=8, G=g, G_PAD=g_pad, HD=hd, BS=16, BT=va.tokens_per_tile(8 * g, 8, split), BN=va.BLOCK_N,
                      IEEE=dtype == "fp32", STAGES=va.KV_STAGES, SPLIT=split, SPLIT_MIN=va.SPLIT_MIN,
                      SPLIT_SHIFT=va.SPLIT_PARTS.bit_length() - 1, MAX_SPLITS=va.MAX_SPLITS, PDL=pdl)
    fn = va._varlen_kernel
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name == "scale_log2":
            sig[name] = "fp32"
        elif name.replace("_", "").isupper():  # pointers
            sig[name] = {"Q": dtype, "K": dtype, "V": dtype, "OUT": dtype, "WS_ML": "fp32", "WS_ACC": "fp32"}.get(name, "i32")
            sig[name] = "*" + sig[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name not in _UNSPECIALIZED:
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = dict(num_warps=va.NUM_WARPS, **({"launch_pdl": True} if pdl else {}))  # as launched
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm




#: (dtype, G, head_dim): llama-1b (32/8 heads, 64), float32 (the CUDA tests' IEEE path; SmolLM2's
#: G of 3, padded to 4), the tiny shape (4/2 heads of 16).
CASES = [("bf16", 4, 64), ("fp32", 3, 64), ("bf16", 2, 16)]


def _dot_signatures(ttgir: str) -> set[str]:
    """The operand and result types of every dot op (wgmma or mma/FMA) in the TTGIR."""
    sigs = set()
    for line in ttgir.splitlines():
        if re.search(r"= (?:ttng\.warp_group_dot|tt\.dot) ", line):
            sigs.add(line.split(" loc(")[0].rsplit(" : ", 1)[1])  # the types after the attributes
    return sigs


def _fusable_mul_adds(ptx: str) -> list[tuple[str, str]]:
    """``(mul, add)`` line pairs where a plain ``mul.f32``'s result is an operand of a plain
    ``add``/``sub.f32`` (ptxas may fuse those; ``.rn`` forms it leaves alone)."""
    muls, pairs = {}, []
    for line in ptx.splitlines():
        m = re.match(r"\s*(mul|add|sub)((?:\.[a-z]+)*)\.f32\s+(%\w+),\s*([^;]+);", line)
        if not m or ".rn" in m.group(2):
            continue
        op, _, dst, srcs = m.groups()
        if op == "mul":
            muls[dst] = line.strip()
        else:
            pairs += [(muls[s.strip()], line.strip()) for s in srcs.split(",") if s.strip() in muls]
    return pairs


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_both_schedules_compile_to_one_arithmetic(case):
    if (why := sm90_compile_problem()) is not None:
        pytest.skip(f"cannot compile for sm_90 here: {why}")
    dtype, g, hd = case
    det = _compiled(True, dtype, g, hd, False)
    sigs = _dot_signatures(det["ttgir"])
    # Q K^T and P V (one type when both are float32 64 x 64), the same in both schedules
    assert len(sigs) == (1 if dtype == "fp32" and hd == va.BLOCK_N else 2), sigs
    assert len(re.findall(r"= (?:ttng\.warp_group_dot|tt\.dot) ", det["ttgir"])) >= 4  # both schedules compiled
    assert not _fusable_mul_adds(det["ptx"]), _fusable_mul_adds(det["ptx"])[:3]


def test_pdl_wait_comes_first():
    """The PDL rule (kernels/pdl.py) in deterministic mode's kernel: one wait, nothing stored,
    updated or copied asynchronously before it (the split grid's counter and partials included)."""
    if (why := sm90_compile_problem()) is not None:
        pytest.skip(f"cannot compile for sm_90 here: {why}")
    for split in (True, False):
        ptx = _compiled(split, "bf16", 4, 64, True)["ptx"]
        assert ptx.count("griddepcontrol.wait") == 1
        before, after = ptx.split("griddepcontrol.wait", 1)
        assert not re.search(r"\bst\.global|\batom\.|\bred\.|\bcp\.async", before)
        assert "griddepcontrol.launch_dependents" in after
