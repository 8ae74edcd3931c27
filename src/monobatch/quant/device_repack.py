"""The repack of :mod:`monobatch.quant.formats` in torch ops, run where the weights will live.

On CUDA the GGUF loader copies a tensor's raw blocks (the file's bytes, 0.56 B a weight for Q4_K)
to the GPU and repacks them there: numpy's repack of the K-quants runs at ~0.15 G weights/s on
one CPU core (an 8B Q4_K_M file would take about a minute), the GPU's at memory speed. The result
is bitwise :func:`monobatch.quant.formats.repack`'s (tests/test_quant_cuda.py checks every type on
CPU tensors); the formulas and the table of layouts are in that module.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from monobatch.quant.formats import PACKED_TYPES, Repacked


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row ``[nb, 2]`` -> float32 ``[nb, 1]``."""
    return b.contiguous().view(torch.float16).float()


def _k_scales(raw: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes ``[nb, 12]`` -> (d * sc, -dmin * m) float32 ``[nb, 8]`` (the 6-bit
    unpacking of gguf-py's ``Q4_K.get_scale_min``: bytes 0-3 sc low 6 bits, 4-7 m low 6 bits, 8-11
    their high parts' low / high nibbles, with the top 2 bits of bytes 0-7)."""
    s = raw.reshape(-1, 3, 4)
    dd, mm, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([dd & 0x3F, (md & 0x0F) | ((dd >> 2) & 0x30)], dim=-1)
    mn = torch.cat([mm & 0x3F, (md >> 4) | ((mm >> 2) & 0x30)], dim=-1)
    return d * sc.float(), -(dmin * mn.float())


def _bits(x: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 ``[..., w]`` -> bits ``[..., n, w]`` (bit i of every byte on axis -2), uint8."""
    shifts = torch.arange(n, dtype=torch.uint8, device=x.device).view(n, 1)
    return (x.unsqueeze(-2) >> shifts) & 1


def _blocks(qtype: T, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw blocks uint8 ``[nb, type_size]`` -> (q, scale, min) as :func:`formats._blocks`."""
    nb = b.shape[0]
    zero1 = torch.full((nb, 1), -0.0, dtype=torch.float32, device=b.device)
    if qtype == T.Q4_0:
        d = _f16(b[:, :2])
        return b[:, 2:], d, -8 * d
    if qtype == T.Q4_1:
        return b[:, 4:], _f16(b[:, :2]), _f16(b[:, 2:4])
    if qtype == T.Q8_0:
        return b[:, 2:].contiguous().view(torch.int8), _f16(b[:, :2]), zero1
    if qtype == T.Q5_0:
        qh = _bits(b[:, 2:6], 8).transpose(1, 2).reshape(nb, 32)  # bit j of the little-endian uint32
        qs = b[:, 6:]
        ql = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
        return (ql | (qh << 4)).to(torch.int8) - 16, _f16(b[:, :2]), zero1
    if qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        scale, minimum = _k_scales(b[:, 4:16], d, dmin)
        qs = b[:, -128:].reshape(nb, 4, 1, 32)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(nb, 8, 32)  # sub-block 2c: low nibbles of chunk c
        if qtype == T.Q4_K:
            return (q[..., :16] | (q[..., 16:] << 4)).reshape(nb, 128), scale, minimum
        qh = _bits(b[:, 16:48], 8)  # [nb, 8, 32]: bit s of byte j is sub-block s's column j
        return (q | (qh << 4)).to(torch.int8).reshape(nb, 256), scale, minimum
    if qtype == T.Q6_K:
        ql = b[:, :128].reshape(nb, 2, 1, 64)
        ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(nb, 8, 32)
        qh = b[:, 128:192].reshape(nb, 2, 1, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
        qh = ((qh >> shifts) & 0x03).reshape(nb, 8, 32)
        q = (ql | (qh << 4)).to(torch.int8) - 32
        d = _f16(b[:, 208:210])
        sc = b[:, 192:208].contiguous().view(torch.int8).float()
        return q.reshape(nb, 256), d * sc, torch.full((nb, 16), -0.0, dtype=torch.float32, device=b.device)
    raise ValueError(f"{qtype.name} has no packed layout")


def repack(qtype: T, data: torch.Tensor, k: int) -> Repacked:
    """A GGUF tensor's raw rows (uint8 ``[N, row bytes]``, any device) -> its resident layout as
    torch tensors on that device (:class:`~monobatch.quant.formats.Repacked` with tensor fields),
    bitwise :func:`monobatch.quant.formats.repack`."""
    layout = PACKED_TYPES[qtype]
    block, size = GGML_QUANT_SIZES[qtype]
    n = data.shape[0]
    q, scale, minimum = _blocks(qtype, data.reshape(n * (k // block), size))
    width = k // 2 if layout.q4 else k
    return Repacked(layout, q.reshape(n, width).contiguous(), scale.reshape(n, k // layout.group).contiguous(),
                    minimum.reshape(n, k // layout.group).contiguous())
