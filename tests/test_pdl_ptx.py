"""The PDL rule of kernels/pdl.py checked on the compiled code: every decode kernel, compiled for
sm_90 with PDL on, stores and updates nothing before ``griddepcontrol.wait`` and loads before it only what no kernel
of the step writes (:data:`KERNELS`: the GEMV's and the norms' weights; the decode attention's
lengths, block table and first key tile, its newest row read again after the wait).

Compiling needs Triton >= 3.4 (its bundled ptxas) but no GPU, so it runs wherever such a Triton is
installed (the GPU machine: scripts/gpu_check.sh); elsewhere (CI's CPU torch has no Triton) it
skips.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

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
from monobatch.kernels import fused, gemv, paged_decode, pdl  # noqa: E402

#: Pointer arguments that are not the model dtype.
_POINTERS = {"WS": "*fp32", "O_PART": "*fp32", "LSE_PART": "*fp32", "CNT": "*i32", "TABLES": "*i32",
             "LENS": "*i32", "SLOTS": "*i64"}
_FLOATS = {"eps", "scale"}
_INTS = {"_gemv_kernel": {"M", "N", "K"}, "_silu_mul_kernel": {"F"}}  # upper-case sizes, per kernel


def _compiled(fn, constexprs: dict, **options) -> dict:
    """The compiled stages of ``fn`` for sm_90 (``asm``: "ttir", "ptx", ...): upper-case arguments
    are pointers (but the sizes in :data:`_INTS`), the rest 32-bit integers divisible by 16 (as
    Triton specializes them at run time)."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in _FLOATS:
            sig[name] = "fp32"
        elif name not in _INTS.get(fn.__name__, ()) and name.replace("_", "").isupper():
            sig[name] = _POINTERS.get(name, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm


def _ptx(fn, constexprs: dict, **options) -> str:
    """PTX of ``fn`` for sm_90 (:func:`_compiled`)."""
    return _compiled(fn, constexprs, **options)["ptx"]


def _loaded_before_the_wait(ttir: str) -> set[str]:
    """The kernel arguments (names) whose memory a ``tt.load`` before ``griddepcontrol.wait`` reads:
    each load's pointer traced back through ``tt.addptr`` / ``splat`` / ``broadcast`` /
    ``expand_dims`` / ``reshape`` to its base (a pointer computed otherwise is named by its op), in
    one pass in program order (Triton reuses a value's name in the two branches of an ``if``: each
    load is traced through the definitions before it). The wait must be one, at the function's top
    level (a wait inside a branch would leave the other branch's loads unchecked)."""
    assert ttir.count("griddepcontrol.wait") == 1, "one wait"
    body = ttir.split("griddepcontrol.wait", 1)[0]
    lines = body.splitlines()
    func = next(i for i, line in enumerate(lines) if "tt.func" in line)
    top = re.match(r"\s*", lines[func + 1]).group(0)
    assert re.match(r"\s*", lines[-1]).group(0) == top, "the wait is at the function's top level"
    bases: dict[str, str] = {}
    loaded = set()
    for line in lines[func + 1:]:
        m = re.match(r"\s*(%[\w.#]+)(?::\d+)? = (\S+) (.*)", line)
        if not m:
            continue
        name, op, rest = m.groups()
        operands = re.findall(r"%[\w.#]+", rest)
        if op == "tt.load":
            loaded.add(bases.get(operands[0], operands[0].lstrip("%")))
        if op in ("tt.addptr", "tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape") and operands:
            bases[name] = bases.get(operands[0], operands[0].lstrip("%"))
        else:
            bases[name] = f"{op} {name}"
    return loaded


def _gemv(**kw):
    base = dict(HAS_BIAS=False, M_PAD=1, BLOCK_N=4, BLOCK_K=2048, STAGES=1, DOT=False, IEEE=False, GATED=False)
    return gemv._gemv_kernel, {**base, **kw}


def _attention(**kw):
    base = dict(NKV=8, G=4, G_PAD=16, HD=64, BS=16, SPLITS=64, BN=64, MIN_PART=256, IEEE=False, STAGES=2,
                STORE=False, LATE=False)
    return paged_decode._partition_kernel, {**base, **kw}


#: What a kernel may read before its wait: nothing another kernel of the step writes. The GEMV
#: and the norms their weights; the decode attention the lengths, the block table and its first
#: key and value tile (older keys; the newest row, which the kernel before it may be writing, is
#: read again after the wait and put in its place); the others nothing.
WEIGHTS, ATTENTION = {"W"}, {"LENS", "TABLES", "K", "V"}
KERNELS = {
    "gemv_fma": (*_gemv(), WEIGHTS),
    "gemv_fma_gated_pipelined": (*_gemv(BLOCK_N=8, BLOCK_K=512, STAGES=3, GATED=True), WEIGHTS),
    "gemv_dot_bias": (*_gemv(HAS_BIAS=True, M_PAD=16, BLOCK_N=64, BLOCK_K=128, STAGES=3, DOT=True), WEIGHTS),
    "rms_norm": (fused._rms_norm_kernel, dict(BLOCK=2048), WEIGHTS),
    "add_rms_norm": (fused._add_rms_norm_kernel, dict(BLOCK=2048), WEIGHTS),
    "rope": (fused._rope_kernel, dict(HALF=32, BLOCK=32), set()),
    "rope_qk": (fused._rope_qk_kernel, dict(NQ=32, NKV=8, HD=64, HALF=32, BLOCK=32, STORE=False), set()),
    "rope_qk_store": (fused._rope_qk_kernel, dict(NQ=32, NKV=8, HD=64, HALF=32, BLOCK=32, STORE=True), set()),
    "silu_mul": (fused._silu_mul_kernel, dict(BLOCK=1024), set()),
    "store_kv": (paged_decode._store_kv_kernel, dict(NKV=8, NKV_PAD=8, HD=64), set()),
    "attention": (*_attention(), ATTENTION),
    "attention_store": (*_attention(STORE=True), ATTENTION),
    "attention_late": (*_attention(LATE=True), ATTENTION),
}
#: The kernels that let the next grid launch before their wait under MONOBATCH_PDL_TRIGGER=small.
SMALL = {"rms_norm", "add_rms_norm", "rope", "rope_qk", "rope_qk_store", "silu_mul"}
#: The kernels that never let the next grid launch (it launches as their programs exit:
#: MONOBATCH_DECODE_LATE_TRIGGER=1), whatever the trigger.
LATE = {"attention_late"}


def _check(name: str) -> None:
    """One kernel under this process's ``pdl.TRIGGER``: one wait; before it no store, atomic or
    async copy (cp.async: a pipelined load, whose operand could be an activation), and loads only
    of the arguments :data:`KERNELS` allows (traced in Triton's IR; none at all in the PTX where
    it allows none); one launch_dependents, before the wait where the trigger makes this kernel
    early, else after it (none for :data:`LATE`); no griddepcontrol with PDL off."""
    fn, constexprs, allowed = KERNELS[name]
    asm = _compiled(fn, {**constexprs, "PDL": True}, num_warps=4, launch_pdl=True)
    ptx = asm["ptx"]
    assert ptx.count("griddepcontrol.wait") == 1, name
    before, after = ptx.split("griddepcontrol.wait", 1)
    assert not re.search(r"\bst\.global|\batom\.|\bred\.|\bcp\.async", before), name
    assert _loaded_before_the_wait(asm["ttir"]) <= allowed, (name, _loaded_before_the_wait(asm["ttir"]))
    if not allowed:
        assert "ld.global" not in before, name
    if name in LATE:
        assert "griddepcontrol.launch_dependents" not in ptx, name
    else:
        assert ptx.count("griddepcontrol.launch_dependents") == 1, name
        early = pdl.TRIGGER == "all" or (pdl.TRIGGER == "small" and name in SMALL)
        assert ("griddepcontrol.launch_dependents" in before) == early, (name, pdl.TRIGGER)
    plain = _ptx(fn, {**constexprs, "PDL": False}, num_warps=4)
    assert "griddepcontrol" not in plain, name


def check_every_kernel() -> str:
    """:func:`_check` on every kernel (run in a subprocess per trigger); returns "ok"."""
    for name in KERNELS:
        _check(name)
    return "ok"


@pytest.mark.parametrize("name", list(KERNELS))
def test_nothing_touched_before_the_wait(name):
    """:func:`_check` under the default trigger ("small": the norms, RoPE and SiLU let the next
    kernel launch before their wait, the others right after it)."""
    if (why := sm90_compile_problem()) is not None:
        pytest.skip(f"cannot compile for sm_90 here: {why}")
    assert pdl.TRIGGER == "small" or os.environ.get("MONOBATCH_PDL_TRIGGER"), "the default trigger changed"
    _check(name)


@pytest.mark.parametrize("trigger", ["wait", "small", "all"])
def test_trigger_modes(trigger):
    """Each ``MONOBATCH_PDL_TRIGGER`` (read at import, so in a fresh process): the small kernels,
    or every kernel, let the next grid launch before their wait and still touch nothing before it."""
    if (why := sm90_compile_problem()) is not None:
        pytest.skip(f"cannot compile for sm_90 here: {why}")
    root = Path(__file__).resolve().parents[1]
    code = (f"import sys; sys.path[:0] = [{str(root / 'src')!r}, {str(root / 'tests')!r}]; "
            "from test_pdl_ptx import check_every_kernel; print(check_every_kernel())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=root,
                          env={**os.environ, "MONOBATCH_PDL_TRIGGER": trigger})
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
