"""The repack of :mod:`monobatch.quant.formats` in torch ops, run where the weights will live.

On CUDA the GGUF loader copies a tensor's raw blocks (the file's bytes, 0.56 B a weight for Q4_K)
to the GPU and repacks them there: numpy's repack of the K-quants runs at ~0.15 G weights/s on
one CPU core (an 8B Q4_K_M file would take about a minute), the GPU's at memory speed. The result
holds the same ``qs`` as :func:`monobatch.quant.formats.repack` and its scales and mins compact
(:data:`~monobatch.quant.formats.DEVICE_LAYOUTS`: the file's float16 and integer factors), which
expand to that function's float32 values bit for bit (tests/test_quant_cuda.py checks every type
on CPU tensors); the formulas and the table of layouts are in that module.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from monobatch.quant.formats import DEVICE_LAYOUTS, Repacked


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row ``[nb, 2]`` -> float16 ``[nb, 1]`` (the file's value)."""
    return b.contiguous().view(torch.float16)


def _k_factors(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes ``[nb, 12]`` -> (sc, m) uint8 ``[nb, 8]`` in 0..63 (the 6-bit
    unpacking of gguf-py's ``Q4_K.get_scale_min``: bytes 0-3 sc low 6 bits, 4-7 m low 6 bits, 8-11
    their high parts' low / high nibbles, with the top 2 bits of bytes 0-7)."""
    s = raw.reshape(-1, 3, 4)
    dd, mm, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([dd & 0x3F, (md & 0x0F) | ((dd >> 2) & 0x30)], dim=-1)
    mn = torch.cat([mm & 0x3F, (md >> 4) | ((mm >> 2) & 0x30)], dim=-1)
    return sc, mn


def _bits(x: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 ``[..., w]`` -> bits ``[..., n, w]`` (bit i of every byte on axis -2), uint8."""
    shifts = torch.arange(n, dtype=torch.uint8, device=x.device).view(n, 1)
    return (x.unsqueeze(-2) >> shifts) & 1


def _blocks(qtype: T, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Raw blocks uint8 ``[nb, type_size]`` -> (q as :func:`formats._blocks`, scale, min, sup) in
    the compact layout :data:`~monobatch.quant.formats.DEVICE_LAYOUTS` gives the type: float16
    scale (and min) ``[nb, bs/G]``, or integer factors with sup float16 ``[nb, 2]`` ``(d, dmin)``."""
    nb = b.shape[0]
    if qtype == T.Q4_0:
        return b[:, 2:], _f16(b[:, :2]), None, None
    if qtype == T.Q4_1:
        return b[:, 4:], _f16(b[:, :2]), _f16(b[:, 2:4]), None
    if qtype == T.Q8_0:
        return b[:, 2:].contiguous().view(torch.int8), _f16(b[:, :2]), None, None
    if qtype == T.Q5_0:
        qh = _bits(b[:, 2:6], 8).transpose(1, 2).reshape(nb, 32)  # bit j of the little-endian uint32
        qs = b[:, 6:]
        ql = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
        return (ql | (qh << 4)).to(torch.int8) - 16, _f16(b[:, :2]), None, None
    if qtype in (T.Q4_K, T.Q5_K):
        sup = b[:, :4].contiguous().view(torch.float16)  # d, dmin
        sc, mn = _k_factors(b[:, 4:16])
        qs = b[:, -128:].reshape(nb, 4, 1, 32)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(nb, 8, 32)  # sub-block 2c: low nibbles of chunk c
        if qtype == T.Q4_K:
            return (q[..., :16] | (q[..., 16:] << 4)).reshape(nb, 128), sc, mn, sup
        qh = _bits(b[:, 16:48], 8)  # [nb, 8, 32]: bit s of byte j is sub-block s's column j
        return (q | (qh << 4)).to(torch.int8).reshape(nb, 256), sc, mn, sup
    if qtype == T.Q6_K:
        ql = b[:, :128].reshape(nb, 2, 1, 64)
        ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(nb, 8, 32)
        qh = b[:, 128:192].reshape(nb, 2, 1, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
        qh = ((qh >> shifts) & 0x03).reshape(nb, 8, 32)
        q = (ql | (qh << 4)).to(torch.int8) - 32
        d = b[:, 208:210].contiguous().view(torch.float16)
        sup = torch.cat([d, torch.zeros_like(d)], dim=-1)  # (d, no dmin)
        return q.reshape(nb, 256), b[:, 192:208].contiguous().view(torch.int8), None, sup
    raise ValueError(f"{qtype.name} has no packed layout")


def repack(qtype: T, data: torch.Tensor, k: int) -> Repacked:
    """A GGUF tensor's raw rows (uint8 ``[N, row bytes]``, any device) -> its compact resident
    layout (:data:`~monobatch.quant.formats.DEVICE_LAYOUTS`) as torch tensors on that device
    (:class:`~monobatch.quant.formats.Repacked` with tensor fields): ``qs`` bitwise
    :func:`monobatch.quant.formats.repack`'s, and the scales and mins that
    :func:`monobatch.kernels.quant_gemm.group_scales` expands to its float32 ones, bit for bit."""
    layout = DEVICE_LAYOUTS[qtype]
    block, size = GGML_QUANT_SIZES[qtype]
    n = data.shape[0]
    q, scale, minimum, sup = _blocks(qtype, data.reshape(n * (k // block), size))
    width = k // 2 if layout.q4 else k
    groups = k // layout.group
    return Repacked(layout, q.reshape(n, width).contiguous(), scale.reshape(n, groups).contiguous(),
                    None if minimum is None else minimum.reshape(n, groups).contiguous(),
                    None if sup is None else sup.reshape(n, k // 256, 2).contiguous())
