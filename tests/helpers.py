"""Test helpers: run requests through the engine, compare token ids with margins, run a Triton
kernel check in the interpreter."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from monobatch.engine.params import SamplingParams
from monobatch.engine.sequence import Request


#: How far the bundled model's logits on packed weights may move between two paths that compute
#: one function (or from HF's float reference), where one of them runs the int16-activation GEMV
#: (``csrc/quant_cpu.cpp``: x rounded per 32-column group, ``sx = amax / 32767``). One GEMV output
#: moves by at most ``sum_j |scale q_j| amax / 65534`` (~1.5e-5 of a group's magnitude), but two
#: paths that feed the GEMV inputs differing by float rounding round some of them to different
#: int16 values, and over the model's 30 layers (with its outlier channels setting a group's amax)
#: that noise reaches ~1e-2 on logits of magnitude ~20. Measured (2026-12-05, ADR 0006 "int16
#: activations"): 2.18e-2 at most (packed vs dequantized logits over the oracle's greedy
#: sequences), 2.1e-2 (prefill logits vs HF), 1.8e-2 (fast vs deterministic mode; 8.4e-5 on
#: dequantized weights), 1.0e-2 (prompt
#: logprobs by chunk size), 7.8e-3 (TP=2 vs TP=1), 5.0e-3 (static vs eager decode KV); the bound
#: is ~2.3x the largest. Tests of a path (chunking, TP, modes) run on
#: ``--weights dequant`` at their float tolerance; this bound is for the packed weights themselves.
PACKED_LOGIT_TOL = 5e-2
#: Greedy tokens on packed weights may leave a float reference's (HF's, the dequantized model's)
#: only where the reference's top-2 margin is below this: each of the two logits moves by at most
#: PACKED_LOGIT_TOL, so a flip needs a margin below twice that. Measured (2026-12-05): on the
#: oracle prompts the packed model's greedy tokens are HF's and the dequantized model's, no
#: divergence (ADR 0006, "int16 activations").
PACKED_NEAR_TIE = 2 * PACKED_LOGIT_TOL
#: The near-tie margin of two default-mode runs of one request on float weights (dequantized, or a
#: safetensors folder): their logits differ by float32 summation orders only (~1e-5 on the bundled
#: model), so a flip needs a margin far below this.
FLOAT_NEAR_TIE = 1e-3


def near_tie(loaded) -> float:
    """The top-2 logit margin under which two default-mode runs of one request on ``loaded`` (a
    ``LoadedModel``) may pick different greedy tokens: :data:`PACKED_NEAR_TIE` on packed weights
    (on CPU a prompt's rows above ``GEMV_ROWS`` take the float GEMM, a decode step's rows the
    int16-activation GEMV, so a token computed by prefill in one run and by a decode step in another
    moves by up to :data:`PACKED_LOGIT_TOL`), :data:`FLOAT_NEAR_TIE` on float weights."""
    return PACKED_NEAR_TIE if loaded.weights == "packed" else FLOAT_NEAR_TIE


def new_scheduler(loaded, **config):
    """A fresh BatchScheduler over already-loaded weights (EngineConfig fields as keywords)."""
    from monobatch.engine.engine import Engine, EngineConfig
    from monobatch.engine.scheduler import BatchScheduler

    return BatchScheduler(Engine(loaded, EngineConfig(**config)))


def run_requests(scheduler, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    """Submit all prompts at once, step to the end; generated ids per prompt, in order."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [Request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, plist))]
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for out in scheduler.run(reqs):
        got[out.request_id] += out.token_ids
    return [got[r.request_id] for r in reqs]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_margin(hf_model, ids: list[int]) -> float:
    """HF's top-2 logit margin for the token after ``ids`` (float32)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def interpreter_numpy_shim() -> None:
    """Let Triton's interpreter run under numpy >= 2.4 (call in a ``TRITON_INTERPRET=1`` process
    before any kernel runs). Triton <= 3.6's interpreter turns a scalar (held as a one-element
    array) into a Python int with ``int(array)``, e.g. for a loop bound, which numpy 2.4 refuses
    ("only 0-dimensional arrays can be converted to Python scalars"; triton-lang/triton#9171,
    fixed upstream by squeezing the array). This wraps the function that patches ``tl.tensor``
    for a kernel's run so that ``__index__`` takes the array's one element; nothing else changes,
    and with a Triton whose interpreter lacks that function it does nothing."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "numpy_shim", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.numpy_shim = True
    interpreter._patch_lang_tensor = patched


def run_in_triton_interpreter(module: str, check: str) -> None:
    """Run ``tests/<module>.py``'s ``check()`` (which returns "ok") in a ``TRITON_INTERPRET=1``
    subprocess: the interpreter is chosen when Triton is imported, so not in this process. It runs
    a kernel's programs one after another on CPU tensors: it checks the arithmetic and counter
    protocols, not the memory ordering between concurrent programs. Skips without Triton, and on
    a GPU (the CUDA tests run instead).

    Raises:
        AssertionError: the check failed (its stderr's tail in the message).
    """
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("on a GPU the CUDA tests run instead")
    root = Path(__file__).resolve().parents[1]
    code = (f"import sys; sys.path[:0] = [{str(root / 'src')!r}, {str(root / 'tests')!r}]; "
            f"import helpers; helpers.interpreter_numpy_shim(); from {module} import {check}; print({check}())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=root,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


@contextlib.contextmanager
def one_gguf_parse():
    """Within the block, ``gguf.GGUFReader(path)`` returns one reader per path: transformers'
    ``from_pretrained(gguf_file=...)`` opens the file twice (config, then weights) and gguf-py
    parses every metadata field each time, a vocabulary of 49K-262K strings as numpy slices
    (about a minute a parse on the CI machine). The reader is only read; it is the loader's
    :class:`~monobatch.loader.gguf_file.MappedReader` (gguf-py's, its header parsed ~3x faster;
    tests/test_loader.py holds it equal to gguf-py's).

    ``gguf.get_tensor_name_map(arch, n_blocks)`` is memoized too: transformers calls it once per
    module of the model it maps (~400 for SmolLM2), and each call rebuilds the same
    ``TensorNameMap`` (every architecture's names formatted for every block: ~17 s of a ~40 s
    load on the CI machine). The map is a pure function of its arguments and is only read."""
    import gguf

    from monobatch.loader.gguf_file import MappedReader

    real, real_map, readers, maps = gguf.GGUFReader, gguf.get_tensor_name_map, {}, {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = MappedReader(path, mode)
        return readers[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = real_map(arch, n_blocks)
        return maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real, real_map


@functools.cache
def sm90_compile_problem() -> str | None:
    """None when the installed Triton compiles for sm_90 here (its NVIDIA backend and ptxas, no
    GPU needed), else why not: the PTX-inspecting tests skip with it."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def probe(X):
        tl.store(X, 1.0)
    try:
        triton.compile(ASTSource(fn=probe, signature={"X": "*fp32"}), target=GPUTarget("cuda", 90, 32))
    except Exception as e:  # pragma: no cover - depends on the install
        return f"{type(e).__name__}: {e}"
    return None


def step_logits(engine, prompts: list[list[int]], n: int) -> list[torch.Tensor]:
    """Every logits tensor the model returns over greedy runs of ``prompts`` together (n tokens each)."""
    from monobatch.engine.params import SamplingParams
    from monobatch.engine.scheduler import BatchScheduler
    from monobatch.engine.sequence import Request

    got: list[torch.Tensor] = []
    hook = engine.model.register_forward_hook(lambda m, i, o: got.append(o.clone()))
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    for _ in BatchScheduler(engine).run([Request(f"r{i}", ids, params) for i, ids in enumerate(prompts)]):
        pass
    hook.remove()
    return got


def padded_deterministic_matches(loaded, prompts: list[list[int]], n: int = 6) -> None:
    """The deterministic mode of a model whose rows are independent (packed CPU weights: unpadded
    tiles of up to 16 rows, the fused routes and the layer chain where the family has them) gives
    every logits tensor of a prompt step, batched decode steps and ``prompt_logits`` bitwise as
    padded 8-row tiles through the unfused layers do (the mode before those kernels took it)."""
    from monobatch.engine.engine import Engine, EngineConfig
    from monobatch.models.layers import CpuRoute

    fast = Engine(loaded, EngineConfig(kv_storage="paged", deterministic=True))
    assert not fast.row_pad and fast.row_tile == 16 and "deterministic (row-independent CPU kernels)" in fast.describe()
    a, a_prompt = step_logits(fast, prompts, n), fast.prompt_logits(prompts[0], all_positions=True)
    # the slow engine after the fast one has run: an unsharded model's module tree is both engines'
    # (the routes switched off below would otherwise be the fast engine's too), restored after
    slow = Engine(loaded, EngineConfig(kv_storage="paged", deterministic=True))
    slow.row_pad, slow.row_tile = True, 8
    routes = [m.cpu_route for m in slow.model.modules() if isinstance(getattr(m, "cpu_route", None), CpuRoute)]
    saved = [r.call for r in routes]
    try:
        for r in routes:
            r.call = False  # the unfused layers: norms, GEMVs, RoPE, activations and sums one call each
        assert "deterministic (row tiles of 8)" in slow.describe()
        b, b_prompt = step_logits(slow, prompts, n), slow.prompt_logits(prompts[0], all_positions=True)
    finally:
        for r, call in zip(routes, saved):
            r.call = call
    assert len(a) == len(b) >= n and all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(a_prompt, b_prompt)
