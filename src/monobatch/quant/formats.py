"""GGUF block types -> the two resident packed layouts, repacked once at load, exactly.

Every packed type is, per group of G consecutive input columns of a row, ``w = q * scale + min``
with small integers q (ggml's own formulas, read from the block's bytes):

| GGUF type | file block | resident layout | scale | min |
| --- | --- | --- | --- | --- |
| Q4_0 | 32: fp16 d, 16 B nibbles | Q4, G 32 (bytes kept) | d | -8 d |
| Q4_1 | 32: fp16 d, fp16 m, 16 B | Q4, G 32 (bytes kept) | d | m |
| Q4_K | 256: fp16 d, dmin, 12 B 6-bit (sc, m) x 8, 128 B | Q4, G 32 (nibbles re-ordered) | d sc | -dmin m |
| Q8_0 | 32: fp16 d, 32 int8 | Q8, G 32 | d | -0.0 |
| Q5_0 | 32: fp16 d, 4 B high bits, 16 B | Q8, G 32, q - 16 | d | -0.0 |
| Q5_K | 256: as Q4_K + 32 B high bits | Q8, G 32, q in 0..31 | d sc | -dmin m |
| Q6_K | 256: 128 B low, 64 B high, 16 int8 sc, fp16 d | Q8, G 16, q - 32 | d sc | -0.0 |

Layouts (what :mod:`monobatch.kernels.quant_cpu` reads): **Q4**: ``qs`` uint8 ``[N, K/2]``, in
each 32-column group byte j = column j (low nibble) | column j+16 (high nibble); **Q8**: ``qs``
int8 ``[N, K]``; both with ``scale`` and ``min`` float32 ``[N, K/G]`` (on CPU the loader stores
them as float16 where every value of a tensor is exactly one: :func:`narrow_scales`). Every scale
and min above is exact in float32 (an fp16 times an integer of at most 8 bits), so ``fma(q, scale, min)`` rounds
once, as gguf-py's ``d * q - dm`` does: the dequantized layouts are bitwise gguf-py's dequantization
(tests/test_quant.py; Q4_0's zeros aside: gguf-py's ``d * (q - 8)`` is -0.0 where d < 0, ours +0.0,
an equal value). Resident bytes per weight with float32 scales: Q4 0.75, Q8 1.25 (G 32) or 1.5
(G 16); with the float16 scales of :func:`narrow_scales`: 0.625, 1.125 and 1.25. The 5- and 6-bit
types are widened to a byte per weight (a 5/6-bit kernel is future work, ADR 0006).

On CUDA the scales are held compact (:data:`DEVICE_LAYOUTS`, made by
:mod:`monobatch.quant.device_repack`): as the file has them — float16 ``d`` (and Q4_1's ``m``) a
group, the K-quants' 6- or 8-bit ``sc`` (and ``m``) a group with a float16 ``d`` (and ``dmin``)
per 256 weights — and no min at all where it is -0.0 or Q4_0's ``-8 d``. The kernels form
``d * sc`` and ``-(dmin * m)`` in float32 registers, products exact as above, so every
dequantized weight keeps its bits, in ~23 % (Q4) to ~29 % (Q6_K) fewer resident bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import Q4_K as _GGUF_Q4_K


#: How a part's per-group scales are held (:class:`Layout`'s ``scales``): a float tensor
#: (float32, or float16 where exact) ``[N, K/G]``, or the file's factors: small integers ``[N, K/G]``
#: (uint8 ``sc`` of Q4_K/Q5_K, int8 ``sc`` of Q6_K) times a float16 ``d`` per 256 weights.
DIRECT, FACTORED = 0, 1
#: How its mins are held (``mins``): DIRECT, FACTORED (uint8 ``m`` times a float16 ``dmin`` per 256
#: weights, negated: ``-(dmin * m)``), ZERO (every min is -0.0, nothing stored) or NEG8 (Q4_0's
#: ``-8 * scale``, nothing stored).
ZERO, NEG8 = 2, 3


@dataclass(frozen=True, slots=True)
class Layout:
    """A resident layout: 4-bit nibbles (``q4``) or int8, the group size G (16 or 32), and how the
    groups' scales and mins are held (``scales``: DIRECT or FACTORED; ``mins``: DIRECT,
    FACTORED, ZERO or NEG8; the CPU's layouts are DIRECT, the compact ones of :data:`DEVICE_LAYOUTS`
    are what CUDA holds)."""

    q4: bool
    group: int
    scales: int = DIRECT
    mins: int = DIRECT

    @property
    def name(self) -> str:
        """``Q4/32``, ``Q8/32`` or ``Q8/16``, with the compact scale codes after a colon
        (``Q4/32:k`` factored, ``:f`` direct with a min of ZERO or NEG8: ``Q8/32:f0``, ``Q4/32:f8``)."""
        base = f"{'Q4' if self.q4 else 'Q8'}/{self.group}"
        if (self.scales, self.mins) == (DIRECT, DIRECT):
            return base
        code = "k" if self.scales == FACTORED else "f"
        return f"{base}:{code}" + {ZERO: "0", NEG8: "8"}.get(self.mins, "")

    @property
    def base(self) -> "Layout":
        """This layout with DIRECT scales and mins (the CPU kernels' form of the same bytes)."""
        return Layout(self.q4, self.group)

    @property
    def super_block(self) -> int:
        """Columns a factored ``d`` covers (256, the K-quants' super-block); G where nothing is factored."""
        return 256 if FACTORED in (self.scales, self.mins) else self.group


Q4 = Layout(True, 32)
Q8 = Layout(False, 32)
Q8_16 = Layout(False, 16)

#: The GGUF types held packed, and the layout each becomes. Others are dequantized at load.
PACKED_TYPES: dict[T, Layout] = {T.Q4_0: Q4, T.Q4_1: Q4, T.Q4_K: Q4, T.Q8_0: Q8, T.Q5_0: Q8,
                                 T.Q5_K: Q8, T.Q6_K: Q8_16}
#: The compact layouts CUDA holds (:mod:`monobatch.quant.device_repack`): the same ``qs`` as
#: :data:`PACKED_TYPES`, the scales and mins as the file has them (float16 ``d`` and ``m``; the
#: K-quants' integer ``sc`` and ``m`` with a float16 ``d`` and ``dmin`` per 256 weights), and no min
#: where it is always -0.0 or Q4_0's ``-8 d``. Bytes a weight: Q4_0 0.5625, Q4_1 0.625, Q4_K 0.578,
#: Q8_0 and Q5_0 1.0625, Q5_K 1.078, Q6_K 1.078 (DIRECT float32: 0.75, 1.25, 1.5).
DEVICE_LAYOUTS: dict[T, Layout] = {
    T.Q4_0: Layout(True, 32, DIRECT, NEG8), T.Q4_1: Layout(True, 32), T.Q4_K: Layout(True, 32, FACTORED, FACTORED),
    T.Q8_0: Layout(False, 32, DIRECT, ZERO), T.Q5_0: Layout(False, 32, DIRECT, ZERO),
    T.Q5_K: Layout(False, 32, FACTORED, FACTORED), T.Q6_K: Layout(False, 16, FACTORED, ZERO)}


@dataclass(slots=True)
class Repacked:
    """One tensor's rows in a resident layout (numpy; the torch side is PackedWeight).

    Attributes:
        qs: uint8 ``[N, K/2]`` (Q4) or int8 ``[N, K]`` (Q8).
        scale, minimum: float32 ``[N, K/G]`` (both float16 after :func:`narrow_scales`, where exact);
            in a compact layout (:data:`DEVICE_LAYOUTS`, torch tensors) as the layout's codes say:
            float16, or uint8/int8 factors; ``minimum`` None where ZERO or NEG8.
        sup: float16 ``[N, K/256, 2]``, each super-block's ``(d, dmin)``, where a code is FACTORED; else None.
    """

    layout: Layout
    qs: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray | None
    sup: np.ndarray | None = None

    def select(self, idx) -> "Repacked":
        """Rows ``idx`` (a slice, or an index array or tensor) of every field, as this class."""
        return type(self)(self.layout, self.qs[idx], self.scale[idx],
                          None if self.minimum is None else self.minimum[idx], None if self.sup is None else self.sup[idx])


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row -> float32 ``[nb, 1]``."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles_q4_0_order(q: np.ndarray) -> np.ndarray:
    """q ``[..., 32]`` in 0..15 -> ``[..., 16]`` bytes, column j low | column j+16 high."""
    return (q[..., :16] | (q[..., 16:] << np.uint8(4))).astype(np.uint8)


def _k_scales(raw: np.ndarray, d: np.ndarray, dmin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes -> (d * sc, -dmin * m), float32 ``[nb, 8]`` (gguf-py unpacks the 6 bits)."""
    sc, m = _GGUF_Q4_K.get_scale_min(np.ascontiguousarray(raw))
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _blocks(qtype: T, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw blocks uint8 ``[nb, type_size]`` -> (q ``[nb, bs]`` uint8/int8 in column order, or
    Q4's packed bytes ``[nb, bs/2]``; scale, min float32 ``[nb, bs/G]``)."""
    nb = blocks.shape[0]
    zero1 = np.full((nb, 1), -0.0, np.float32)  # -0.0: q * s + (-0.0) keeps the product's sign of zero
    if qtype == T.Q4_0:
        d = _f16(blocks[:, :2])
        return blocks[:, 2:], d, -8 * d
    if qtype == T.Q4_1:
        return blocks[:, 4:], _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    if qtype == T.Q8_0:
        return blocks[:, 2:].view(np.int8), _f16(blocks[:, :2]), zero1
    if qtype == T.Q5_0:
        qh = np.ascontiguousarray(blocks[:, 2:6]).view(np.uint32) >> np.arange(32, dtype=np.uint32)
        qs = blocks[:, 6:]
        ql = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        q = (ql | ((qh & 1).astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
        return q, _f16(blocks[:, :2]), zero1
    if qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        scale, minimum = _k_scales(blocks[:, 4:16], d, dmin)
        qs = blocks[:, -128:].reshape(nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(nb, 8, 32)  # sub-block 2c: low nibbles of chunk c, 2c+1: high
        if qtype == T.Q4_K:
            return _nibbles_q4_0_order(q).reshape(nb, 128), scale, minimum
        qh = blocks[:, 16:48].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = (q | ((qh & 1) << 4)).astype(np.int8)
        return q.reshape(nb, 256), scale, minimum
    if qtype == T.Q6_K:
        ql = blocks[:, :128].reshape(nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        ql = (ql & 0x0F).reshape(nb, 8, 32)
        qh = blocks[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        qh = (qh & 0x03).reshape(nb, 8, 32)
        q = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
        d = _f16(blocks[:, 208:210])
        return q.reshape(nb, 256), d * blocks[:, 192:208].view(np.int8).astype(np.float32), np.full((nb, 16), -0.0, np.float32)
    raise ValueError(f"{qtype.name} has no packed layout")


def narrow_scales(rep: Repacked) -> Repacked:
    """``rep`` with its scales and mins stored as float16 where every one of them is exactly a
    float16 (then both are; else ``rep`` as it is): 2 bytes a group instead of 4 each. Exact for
    the types whose scale and min are the file's fp16 values (Q4_1's d and m, Q8_0's and Q5_0's d
    with the -0.0 min; Q4_0's -8 d unless it overflows), rarely for the K-quants' ``d * sc``
    products. The CPU kernels widen them back to float32 exactly, so the products' bits do not
    change; the bundled model's packed weights 115 -> 98 MB (issue 17's RSS, 2026-12-03)."""
    with np.errstate(over="ignore"):  # a value past float16's range becomes inf: not equal, kept float32
        scale, minimum = rep.scale.astype(np.float16), rep.minimum.astype(np.float16)
    if np.array_equal(scale.astype(np.float32), rep.scale) and np.array_equal(minimum.astype(np.float32), rep.minimum) \
            and np.array_equal(np.signbit(scale), np.signbit(rep.scale)) \
            and np.array_equal(np.signbit(minimum), np.signbit(rep.minimum)):
        return Repacked(rep.layout, rep.qs, scale, minimum)
    return rep


def resident_bytes(qtype: T, n_weights: int, compact: bool = False) -> int:
    """Bytes ``n_weights`` of ``qtype`` take once repacked: q plus float32 scale and min a group
    (at most: :func:`narrow_scales` may halve the scales' and mins' bytes), or with ``compact``
    the layout of :data:`DEVICE_LAYOUTS` (exactly)."""
    layout = (DEVICE_LAYOUTS if compact else PACKED_TYPES)[qtype]
    q = n_weights // (2 if layout.q4 else 1)
    if not compact:
        return q + n_weights // layout.group * 8
    groups = n_weights // layout.group
    scale = groups * (1 if layout.scales == FACTORED else 2)
    minimum = {DIRECT: 2 * groups, FACTORED: groups}.get(layout.mins, 0)
    sup = n_weights // 256 * 4 if layout.super_block == 256 else 0
    return q + scale + minimum + sup


def repack(qtype: T, data: np.ndarray, k: int) -> Repacked:
    """A GGUF tensor's raw rows -> its resident layout.

    Args:
        qtype: one of :data:`PACKED_TYPES`.
        data: uint8 ``[N, bytes per row]`` (gguf-py's ``ReaderTensor.data`` of a 2-D tensor).
        k: the row length K in weights (a multiple of the type's block size).

    Returns:
        :class:`Repacked` with N rows.
    """
    layout = PACKED_TYPES[qtype]
    block, size = GGML_QUANT_SIZES[qtype]
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n * (k // block), size)
    q, scale, minimum = _blocks(qtype, blocks)
    width = k // 2 if layout.q4 else k
    return Repacked(layout, np.ascontiguousarray(q).reshape(n, width),
                    np.ascontiguousarray(scale, np.float32).reshape(n, k // layout.group),
                    np.ascontiguousarray(minimum, np.float32).reshape(n, k // layout.group))
