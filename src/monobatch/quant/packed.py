"""PackedWeight: a linear layer's ``[N, K]`` weight held in its packed layout, and its matmul.

A weight is one or more row ranges ("parts", each in one layout of :mod:`monobatch.quant.formats`):
a fused projection whose pieces came in different GGUF types (a Q4_K_M file's Q4_K q/k beside a
Q6_K v) keeps each piece packed as it came, and the matmul concatenates the parts' outputs.

The matmul (:meth:`PackedWeight.matmul`), on CPU:

- up to :data:`GEMV_ROWS` rows (decode steps, small batches): the packed kernel
  (:func:`monobatch.kernels.quant_cpu.gemm`), which rounds each x row to int16 per weight group
  (``sx = amax / 32767``), takes exact integer group dots and accumulates in float32: within
  ``~amax / 65534`` per activation of the float product (ADR 0006, "int16 activations"); a row's
  result depends on that row alone, whatever M is.
- more rows (prefill): the part is dequantized into float32 (at most :data:`DEQUANT_CHUNK_BYTES`
  at a time, into one scratch buffer per thread) and multiplied by ``F.linear``, so prefill keeps the BLAS GEMM's
  speed; the dequantized rows are bitwise the dequant path's weights.

On CUDA every M goes to the Triton kernels of :mod:`monobatch.kernels.quant_gemm` (a dequantizing
GEMV up to 16 rows, a dequantizing tiled GEMM above; one fixed tile for every M in the
batch-invariant mode), each part writing its columns of one output; lookups dequantize the
gathered rows with torch ops (:func:`monobatch.kernels.quant_gemm.dequantize`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from monobatch.kernels import quant_cpu
from monobatch.kernels import quant_gemm
from monobatch.kernels.common import triton
from monobatch.quant.formats import Layout, Repacked

#: Most rows the packed kernel takes; more go through dequantize-then-GEMM (measured, ADR 0006).
GEMV_ROWS = 16
#: Float32 bytes dequantized at a time for the GEMM path. 4 MiB (2026-12-01, 2-core Zen 1, -t 2):
#: prefill 184 tok/s at 128 tokens and 205 at 512 vs 130 and 155 with 16 MiB (the chunk stays in
#: the L3 between its dequantization and its GEMM), and 12 MB less resident scratch.
DEQUANT_CHUNK_BYTES = 4 << 20
_scratch = threading.local()  # the GEMM path's dequantization buffer, one per thread (reused: no page faults)


def _dequant_buffer(rows: int, k: int) -> torch.Tensor:
    """A float32 ``[rows, k]`` view of this thread's reusable scratch buffer: made at first use
    with :data:`DEQUANT_CHUNK_BYTES` (every chunk fits, so it is never regrown: a regrown buffer
    left its first, smaller block as a hole in the heap), larger only for a single row wider than that."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < rows * k:
        buf = _scratch.buf = torch.empty(max(rows * k, DEQUANT_CHUNK_BYTES // 4), dtype=torch.float32)
    return buf[:rows * k].view(rows, k)


def packed_supported(device: torch.device) -> bool:
    """Whether weights can be held packed on ``device``: CPU with the compiled kernels, CUDA with
    Triton (the default on both since 2026-12-06: ADR 0006, "Packed by default on CUDA")."""
    if device.type == "cuda":
        return triton is not None
    return device.type == "cpu" and quant_cpu.available()


@dataclass(slots=True)
class PackedPart(Repacked):
    """``rows`` consecutive output rows in one layout: :class:`~monobatch.quant.formats.Repacked`'s
    fields as torch tensors. On CPU DIRECT scale and minimum, float32 or both float16
    (:func:`monobatch.quant.formats.narrow_scales`); on CUDA the compact layouts of
    :data:`~monobatch.quant.formats.DEVICE_LAYOUTS` too (the CPU kernels read DIRECT ones only)."""

    @property
    def rows(self) -> int:
        """N of this part."""
        return self.qs.shape[0]

    @property
    def nbytes(self) -> int:
        """Resident bytes."""
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scale, self.minimum, self.sup) if t is not None)

    @property
    def compact(self) -> bool:
        """Whether the scales are held in a compact layout (any code but DIRECT), which the CPU
        kernels do not read: their calls go through :meth:`direct` then."""
        return bool(self.layout.scales or self.layout.mins)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x float32 ``[M, K]`` -> float32 ``[M, rows]`` with the packed kernel (CPU)."""
        if self.compact:
            return self.direct().gemm(x)
        return quant_cpu.gemm(x, self.qs, self.scale, self.minimum, self.layout.group, self.layout.q4)

    def mat(self):
        """This part bound as the extension's ``PackedMat`` (CPU): one argument of the fused
        decode-layer ops (:mod:`monobatch.kernels.cpu_ops`) instead of five."""
        p = self.direct()
        return quant_cpu.module().PackedMat(p.qs, p.scale, p.minimum, p.layout.group, p.layout.q4)

    def to(self, device: torch.device) -> "PackedPart":
        """This part's tensors on ``device`` (the same object where they are already there). A
        compact layout moved to the CPU becomes DIRECT float32 scales and mins
        (:func:`monobatch.kernels.quant_gemm.group_scales`: the same values), which the CPU kernels read."""
        device = torch.device(device)
        if self.qs.device == device:
            return self
        if device.type == "cpu" and self.compact:
            return self.direct().to(device)
        return PackedPart(self.layout, *(None if t is None else t.to(device)
                                         for t in (self.qs, self.scale, self.minimum, self.sup)))

    def direct(self) -> "PackedPart":
        """This part with DIRECT float32 scales and mins (:func:`monobatch.kernels.quant_gemm.group_scales`:
        the same values; the same ``qs``), on its device; itself where it is DIRECT already."""
        if not self.compact:
            return self
        scale, minimum = quant_gemm.group_scales(self)
        return PackedPart(self.layout.base, self.qs, scale, minimum)

    def dequantize(self, lo: int, hi: int, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``lo:hi`` as float32 ``[hi - lo, K]`` (CPU: into ``out`` when given, contiguous)."""
        if self.qs.device.type != "cpu":
            return quant_gemm.dequantize(self.select(slice(lo, hi)))
        out = torch.empty(hi - lo, k, dtype=torch.float32) if out is None else out
        p = self.select(slice(lo, hi)).direct()
        return quant_cpu.dequant(p.qs, p.scale, p.minimum, p.layout.group, p.layout.q4, out)

    def take(self, ids: torch.Tensor, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids`` (int64 ``[T]``) as ``[T, K]`` (an embedding lookup): float32 on CPU; on CUDA in
        ``dtype``, one Triton launch (:func:`monobatch.kernels.quant_gemm.take`)."""
        if self.qs.device.type == "cuda" and triton is not None:
            return quant_gemm.take(ids, self, dtype)
        if self.qs.device.type != "cpu":
            return quant_gemm.dequantize(self.select(ids))
        out = torch.empty(ids.shape[0], k, dtype=torch.float32)
        p = self.select(ids).direct()
        return quant_cpu.dequant(p.qs, p.scale, p.minimum, p.layout.group, p.layout.q4, out)


class PackedWeight:
    """A weight ``[N, K]`` held packed (parts stacked along N).

    Args:
        parts: the row ranges in order; adjacent parts of one layout should be merged by
            :meth:`from_repacked`.
        k: K, the input width.
        types: the GGUF type names the parts came from (for display).
    """

    def __init__(self, parts: list[PackedPart], k: int, types: tuple[str, ...]) -> None:
        self.parts = parts
        self.k = k
        self.types = types

    @classmethod
    def from_repacked(cls, pieces: list[tuple[Repacked, str]], k: int) -> "PackedWeight":
        """Stack repacked row ranges (each with its GGUF type name; numpy arrays, or torch tensors
        of one device: :mod:`monobatch.quant.device_repack`), merging neighbours of one layout."""
        merged: list[tuple[Layout, list[Repacked]]] = []
        for rep, _ in pieces:
            if merged and merged[-1][0] == rep.layout:
                merged[-1][1].append(rep)
            else:
                merged.append((rep.layout, [rep]))
        def stack(arrays: list) -> torch.Tensor:  # one piece: its own (fresh) array, no copy
            if isinstance(arrays[0], torch.Tensor):
                return arrays[0] if len(arrays) == 1 else torch.cat(arrays)
            return torch.from_numpy(arrays[0] if len(arrays) == 1 else np.concatenate(arrays))

        parts = [PackedPart(layout, *(None if getattr(reps[0], f) is None else stack([getattr(r, f) for r in reps])
                                      for f in ("qs", "scale", "minimum", "sup")))
                 for layout, reps in merged]
        return cls(parts, k, tuple(dict.fromkeys(t for _, t in pieces)))

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``."""
        return sum(p.rows for p in self.parts), self.k

    @property
    def nbytes(self) -> int:
        """Resident bytes of every part."""
        return sum(p.nbytes for p in self.parts)

    @property
    def device(self) -> torch.device:
        """Where the packed bytes live."""
        return self.parts[0].qs.device

    def to(self, device: torch.device) -> "PackedWeight":
        """Move every part to ``device`` (in place; returns self)."""
        self.parts = [p.to(device) for p in self.parts]
        return self

    def __repr__(self) -> str:
        return f"PackedWeight({self.shape[0]}x{self.k}, {'+'.join(self.types)}, {self.nbytes} B)"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``F.linear(x, W, bias)``: x ``[..., K]`` -> ``[..., N]`` in ``out_dtype`` (None: x's dtype).

        Raises:
            NotImplementedError: x on a device without a packed kernel (neither CPU nor CUDA).
        """
        if x.is_cpu and x.dim() == 2 and x.shape[0] <= GEMV_ROWS and len(self.parts) == 1 and bias is None \
                and x.dtype is torch.float32 and out_dtype in (None, torch.float32):
            return self.parts[0].gemm(x)  # a decode step's projection on CPU: the kernel, nothing around it
        if x.device.type == "cuda":
            return self.cuda_matmul(x, bias, out_dtype)
        if x.device.type != "cpu":
            raise NotImplementedError(f"no packed matmul on {x.device.type}")
        lead, K = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, K).float()
        if x2.shape[0] <= GEMV_ROWS:
            outs = [p.gemm(x2) for p in self.parts]
        else:
            outs = [self.dequant_gemm(x2, p) for p in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype or x.dtype).view(*lead, y.shape[-1])

    def cuda_matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None, gated: bool = False) -> torch.Tensor:
        """:meth:`matmul` on CUDA: x ``[..., K]`` (bf16/fp16, or fp32) -> ``[..., N]`` by
        :func:`monobatch.kernels.quant_gemm.matmul`, one launch a part, each writing its columns of
        one output (no concatenation; two parts in one DP4A launch where
        :func:`monobatch.kernels.quant_gemm.gemv_pair` applies); where :func:`monobatch.kernels.quant_gemm.dequant_rows`
        (prompts, batches), every part dequantized into one temporary and one cuBLAS product
        (:func:`monobatch.kernels.quant_gemm.dequant_matmul`: the dequant path's bits, fused
        weights included). Capturable in a CUDA graph. With ``gated``, x is ``[..., 2K]``
        SwiGLU gate/up rows and the product's input ``silu(gate) * up`` (the down projection: the
        SiLU computed inside the GEMV, with :func:`monobatch.kernels.fused.silu_mul`'s bits)."""
        lead, K = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, K)
        if quant_gemm.dequant_rows(x2):  # prompts, batches: one dequantized temporary, one cuBLAS product
            y = quant_gemm.dequant_matmul(x2, self.parts, bias, out_dtype, gated)
        elif len(self.parts) == 1:
            y = quant_gemm.matmul(x2, self.parts[0], bias, out_dtype, gated=gated)
        else:
            y = torch.empty(x2.shape[0], self.shape[0], dtype=out_dtype or x.dtype, device=x.device)
            if not quant_gemm.gemv_pair(x2, self.parts, y, bias, gated):  # else both parts in one launch
                lo = 0
                for p in self.parts:
                    hi = lo + p.rows
                    quant_gemm.matmul(x2, p, None if bias is None else bias[lo:hi], out=y[:, lo:hi], gated=gated)
                    lo = hi
        return y.view(*lead, y.shape[-1])

    def dequant_gemm(self, x: torch.Tensor, part: PackedPart) -> torch.Tensor:
        """The GEMM path: x float32 ``[M, K]`` @ part^T, the part dequantized into float32 a chunk of
        rows at a time (:data:`DEQUANT_CHUNK_BYTES`, into a per-thread buffer reused by every call),
        each chunk's product written by the GEMM into its columns of the output (the bits of
        ``F.linear`` of the chunk, without its temporary and copy): ``[M, rows]``."""
        step = max(1, DEQUANT_CHUNK_BYTES // (4 * self.k))
        if part.rows <= step:
            return F.linear(x, part.dequantize(0, part.rows, self.k, _dequant_buffer(part.rows, self.k)))
        out = torch.empty(x.shape[0], part.rows, dtype=torch.float32)
        for lo in range(0, part.rows, step):
            hi = min(lo + step, part.rows)
            torch.mm(x, part.dequantize(lo, hi, self.k, _dequant_buffer(hi - lo, self.k)).t(), out=out[:, lo:hi])
        return out

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (int64 ``[T]``) in ``dtype``: ``[T, K]`` (``F.embedding`` of the dequantized W)."""
        if len(self.parts) == 1:
            return self.parts[0].take(ids, self.k, dtype).to(dtype)
        return self.dequantize()[ids].to(dtype)

    def dequantize(self) -> torch.Tensor:
        """The whole weight as float32 ``[N, K]`` (tests, and the fallback to dense weights)."""
        return torch.cat([p.dequantize(0, p.rows, self.k) for p in self.parts])


def packed_weights(model: torch.nn.Module) -> list[PackedWeight]:
    """Every PackedWeight a model's modules hold (attributes, not parameters)."""
    return [v for m in model.modules() for v in vars(m).values() if isinstance(v, PackedWeight)]


def dequant_scratch_bytes(model: torch.nn.Module) -> int:
    """Bytes of the widest CUDA packed weight dequantized into the model's dtype: the temporary a
    prompt or batch step's packed product makes (:func:`monobatch.kernels.quant_gemm.dequant_matmul`;
    one at a time, reused, but inside a captured CUDA graph kept in the graph's pool), which the
    KV pool's sizing leaves free. 0 without packed weights on CUDA."""
    elt = torch.empty(0, dtype=getattr(model, "dtype", torch.bfloat16)).element_size()
    return max((w.shape[0] * w.shape[1] for w in packed_weights(model) if w.device.type == "cuda"), default=0) * elt


def weight_bytes(model: torch.nn.Module) -> int:
    """Resident bytes of a model's weights: its parameters plus its packed weights."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(w.nbytes for w in packed_weights(model))
