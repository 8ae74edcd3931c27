"""Filling a model (any family) from HF-named tensors, whatever the file format, with a memory check."""

from __future__ import annotations

import ctypes
import gc
import resource
import sys

import numpy as np
import psutil
import torch
from tqdm import tqdm

from monobatch.errors import InsufficientMemoryError, UnsupportedModelError
from monobatch.models.args import ModelArgs
from monobatch.models import registry
from monobatch.models.layers import PACKED, DecoderModel, hold_packed
from monobatch.quant.formats import Repacked
from monobatch.quant.packed import PackedWeight

#: Fraction of the free memory the dequantized weights may take; the rest is left for the KV
#: cache, activations and the OS.
MEMORY_HEADROOM = 0.9


def available_memory(device: torch.device) -> int:
    """Free memory in bytes: MemAvailable for CPU (psutil), cudaMemGetInfo's free for CUDA."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes (getrusage: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


_MALLOC_TRIM: list = []  # glibc's malloc_trim, looked up at the first release (None: not glibc)


def _malloc_trim():
    """glibc's ``malloc_trim`` through ctypes (this process's own symbols), or None where the C
    library has none (not glibc, not Linux)."""
    if not _MALLOC_TRIM:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None).malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _MALLOC_TRIM.append(fn)
    return _MALLOC_TRIM[0]


def release_freed_memory() -> None:
    """Hand the heap pages that loading freed back to the OS: a garbage collection, then glibc's
    ``malloc_trim(0)``, which returns the free pages inside the heap as well as at its top
    (``MADV_DONTNEED``). Parsing a GGUF header makes ~250K short-lived numpy views and the
    tokenizer's long-lived objects land between them, and repacking leaves freed numpy buffers
    behind: without it the bundled model keeps ~14 MiB more resident after loading (419 -> 405
    MiB), and the dequant path's ``generate`` peaked at 914 rather than 842 MiB (2026-12-02, this
    project's CPU machine; ADR 0006). A no-op where the C library is not glibc."""
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """glibc's ``malloc_trim(0)`` alone (no garbage collection): the heap's free pages, inside it
    as well as at its top, go back to the OS (``MADV_DONTNEED``). The engine calls it on CPU when
    decode follows a prompt step (:meth:`monobatch.engine.engine.Engine.forward`). A no-op where
    the C library is not glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def check_memory(args: ModelArgs, dtype: torch.dtype, device: torch.device, need: int | None = None,
                 held: str | None = None) -> int:
    """Refuse to load weights that would not fit; returns the bytes the weights will take.

    Args:
        need: the weights' resident bytes when known (packed weights); default: every parameter in ``dtype``.
        held: how they are held, for the message (default: the dtype's name).

    Raises:
        InsufficientMemoryError: weights need more than ``MEMORY_HEADROOM`` of free memory.
    """
    if need is None:
        need = args.num_parameters() * torch.tensor([], dtype=dtype).element_size()
    free = available_memory(device)
    if need > MEMORY_HEADROOM * free:
        raise InsufficientMemoryError(
            f"the weights need {need / 2**30:.2f} GiB as {held or str(dtype).removeprefix('torch.')} on {device.type}, "
            f"but only {free / 2**30:.2f} GiB is free; try a smaller model or --dtype bfloat16"
        )
    return need


def new_model(args: ModelArgs, device: torch.device, dtype: torch.dtype,
              freq_factors: torch.Tensor | None = None, held: frozenset[str] | set[str] = frozenset()) -> DecoderModel:
    """An unfilled model of ``args``' family (:mod:`monobatch.models.registry`) with its parameters
    allocated (uninitialised) on ``device`` in ``dtype`` (floating-point tensors; others keep theirs),
    but those named in ``held`` (``named_parameters`` names: the weights the loader will hold
    packed, :func:`monobatch.models.layers.hold_packed`), which stay on the meta device: never
    allocated, so loading a packed model never needs its dense size (on CUDA ``torch.empty`` takes
    the memory at once: ~15 GiB of bfloat16 for llama-8b, whose packed weights take 5).

    Built on the meta device, then every tensor replaced by ``torch.empty`` of its shape: not
    ``Module.to_empty``, whose ``empty_like`` of a meta tensor runs torch's Python reference and
    imports ``torch.fx.experimental.symbolic_shapes`` and with it sympy and mpmath, ~24 MiB
    resident for the rest of the process (2026-12-03, torch 2.13; issue 17's RSS)."""
    with torch.device("meta"):
        model = registry.family(args.model_type).Model(args, freq_factors)
    keep = {id(p) for name, p in model.named_parameters() if name in held}
    model._apply(lambda t: t if id(t) in keep else
                 torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device))
    for rope in model.ropes:
        rope.to(device)
    return model


def param_target(name: str, args: ModelArgs) -> tuple[str, slice | None, int]:
    """HF name (``model.`` prefix optional) -> (our parameter's name, its row slice or None, how
    many slices make it whole): q/k/v fill ``qkv_proj``, gate/up fill ``gate_up_proj``."""
    name = name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed_tokens", None, 1
    q, kv, f = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim, args.intermediate_size
    slices = {"self_attn.qkv_proj": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)], "mlp.gate_up_proj": [(0, f), (f, 2 * f)]}
    for hf, (packed, idx) in PACKED.items():
        marker = f".{hf}."
        if marker in name:
            prefix, suffix = name.split(marker)
            lo, hi = slices[packed][idx]
            return f"{prefix}.{packed}.{suffix}", slice(lo, hi), len(slices[packed])
    return name, None, 1


class WeightFiller:
    """Copies HF-named tensors (``layers.3.self_attn.q_proj.weight``; ``model.`` prefix optional)
    into a model's (packed) parameters, converting dtype and device, and tracks what is missing.
    """

    def __init__(self, model: DecoderModel) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.args = model.args
        self.filled: set[str] = set()
        self._parts: dict[str, int] = {}
        self._packed: dict[str, dict[int, tuple[Repacked, str]]] = {}

    def fill(self, name: str, value: np.ndarray | torch.Tensor) -> None:
        """Copy one tensor. Raises UnsupportedModelError on an unknown name or a shape mismatch."""
        target, rows, parts = param_target(name, self.args)
        param = self.params.get(target)
        if param is None:
            raise UnsupportedModelError(f"unexpected tensor {name!r} for a {self.args.model_type} model")
        dst = param.data if rows is None else param.data[rows]
        src = torch.from_numpy(np.array(value, copy=False) if value.flags.writeable else value.copy()) if isinstance(value, np.ndarray) else value
        if tuple(src.shape) != tuple(dst.shape):
            raise UnsupportedModelError(f"tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(src)
        self._parts[target] = self._parts.get(target, 0) + 1
        if self._parts[target] == parts:
            self.filled.add(target)

    def fill_packed(self, name: str, value: Repacked, qtype: str) -> None:
        """Take one tensor's packed rows (of GGUF type ``qtype``); once every slice of its fused
        parameter has come, the parameter is replaced by one :class:`PackedWeight`
        (:func:`monobatch.models.layers.hold_packed`). Every slice of a fused parameter must come
        packed (the loader decides per parameter).

        Raises:
            UnsupportedModelError: an unknown name or a shape mismatch.
        """
        target, rows, parts = param_target(name, self.args)
        param = self.params.get(target)
        if param is None:
            raise UnsupportedModelError(f"unexpected tensor {name!r} for a {self.args.model_type} model")
        n_rows = param.shape[0] if rows is None else rows.stop - rows.start
        k = value.qs.shape[1] * (2 if value.layout.q4 else 1)
        if (value.qs.shape[0], k) != (n_rows, param.shape[1]):
            raise UnsupportedModelError(f"tensor {name!r} has shape {(value.qs.shape[0], k)}, expected {(n_rows, param.shape[1])}")
        pieces = self._packed.setdefault(target, {})
        pieces[0 if rows is None else rows.start] = (value, qtype)
        if len(pieces) == parts:
            module_name, _, attr = target.rpartition(".")
            module = self.model.get_submodule(module_name) if module_name else self.model
            hold_packed(module, attr, PackedWeight.from_repacked([pieces[i] for i in sorted(pieces)], k))
            del self._packed[target]
            self.filled.add(target)

    def finish(self) -> DecoderModel:
        """Check every parameter was filled.

        Raises:
            UnsupportedModelError: naming the first missing tensor.
        """
        missing = sorted(set(self.params) - self.filled)
        if missing:
            raise UnsupportedModelError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[0]!r}")
        return self.model


def progress_bar(total_bytes: int, desc: str, enabled: bool) -> tqdm:
    """A tqdm bar on stderr counting bytes read; ``update(n)`` per tensor. Shown only when stderr
    is a terminal, so logs and error output stay free of carriage-return redraws."""
    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, file=sys.stderr,
                disable=not (enabled and sys.stderr.isatty()), leave=False, dynamic_ncols=True)
