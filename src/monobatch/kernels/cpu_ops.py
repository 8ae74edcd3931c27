"""Fused float32 CPU ops of a decode step (``csrc/cpu_ops.cpp``, compiled into the packed-weight
extension of :mod:`monobatch.kernels.quant_cpu`).

A B=1 decode step of a small model on CPU is hundreds of tiny torch ops, each microseconds of
dispatch for nanoseconds of arithmetic: RMSNorm is six ops, RoPE five per tensor, the SwiGLU
product two, and the paged KV store's attention a gather of every cached key and value plus a
flash-attention call per layer. These do each job in one call (the CPU counterpart of the CUDA
:mod:`monobatch.kernels.fused`); :func:`attention` reads the keys in place through the block
table. Every output row is computed alone, in a fixed order, so a token's result does not depend
on the rows beside it (the deterministic mode's guarantee, ADR 0002); the torch code in
:mod:`monobatch.models.layers` and :mod:`monobatch.kv.attention` stays the reference and the path
for other dtypes.

``MONOBATCH_CPU_KERNELS=0`` turns them off (A/B measurements).
"""

from __future__ import annotations

import functools

import torch

from monobatch import env
from monobatch.kernels import quant_cpu

_ON = env.flag("MONOBATCH_CPU_KERNELS", True)


@functools.cache
def _available() -> bool:
    return _ON and quant_cpu.available()


def available() -> bool:
    """Whether the fused CPU ops are on: the extension built, not switched off."""
    return _available()


def op(name: str):
    """The extension's function ``name`` itself (a caller that binds it once skips this module's
    wrapper frame: :class:`monobatch.models.layers.CpuRoute`)."""
    return getattr(quant_cpu.module(), name)


def enabled(x: torch.Tensor) -> bool:
    """True when ``x`` takes the fused CPU path: a float32 CPU tensor, the extension built, not
    switched off."""
    return x.dtype is torch.float32 and x.is_cpu and _available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row: x float32 ``[..., D]``, weight ``[D]`` -> new ``[..., D]``,
    ``weight * x / sqrt(mean(x^2) + eps)``."""
    return quant_cpu.module().rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: x, delta float32 ``[T, D]`` -> ``(x + delta, rms_norm(x + delta))``
    (new tensors)."""
    s, y = quant_cpu.module().add_rms_norm(x, delta, weight, eps)
    return s, y


def rope_qk_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """HF rotate_half RoPE of the first ``heads`` head-wide blocks of each row (q's then k's
    heads), in place: qkv float32 ``[T, W]``, cos/sin ``[T, head_dim]`` (rows contiguous, any
    row stride)."""
    quant_cpu.module().rope_qk_(qkv, cos, sin, heads, head_dim)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of gate_up float32 ``[T, 2F]`` (gate first) -> new ``[T, F]``."""
    return quant_cpu.module().silu_mul(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` of gate_up float32 ``[T, 2F]`` (gate first) -> new ``[T, F]``: GeGLU with
    HF's ``gelu_pytorch_tanh``, computed as ``g / (1 + e^(-2u))``, ``u = sqrt(2/pi) (g + 0.044715 g^3)``
    (``(1 + tanh(u)) / 2`` is ``sigmoid(2u)``); within a few float32 ulp of torch's, every element
    by the same operations wherever it lies (batch invariant)."""
    return quant_cpu.module().gelu_tanh_mul(gate_up)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              write: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor, block_size: int, window: int,
              out: torch.Tensor | None) -> torch.Tensor:
    """Store a step's new K/V, then causal attention of query rows over a cache read in place.

    Args:
        q: float32 ``[T, H, hd]``; k, v: ``[T, n_kv, hd]`` (heads contiguous, any token stride:
            views of the packed qkv projection).
        k_cache, v_cache: float32 ``[slots, n_kv, hd]`` contiguous; row ``t`` of k/v is written
            to slot ``write[t]`` (int64 ``[T]``) first.
        rows: int64 ``[R, 3]``: (row of q, its position p, offset of its sequence's block table
            in ``tables``); position j of the sequence lives at slot
            ``tables[off + j // block_size] * block_size + j % block_size``.
        tables: int32 block ids (a dense buffer: ``[0]`` with ``block_size`` its capacity).
        window: 0, or a sliding window (the row sees positions ``max(0, p - window + 1) .. p``).
        out: float32 ``[T, H, hd]`` contiguous; the rows named in ``rows`` are written. None: a
            new one (when ``rows`` names every row).

    Returns:
        ``out`` (or the new one). Softmax scale ``1/sqrt(hd)``; each row alone (its query and the keys it sees).

    Raises:
        RuntimeError: shapes, dtypes or indices out of range (checked before anything is written
            past the new K/V).
    """
    return quant_cpu.module().attention(q, k, v, k_cache, v_cache, write, rows, tables, block_size, window, out)


def add_norm_qkv_rope(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, qkv_w,
                      cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv: int, head_dim: int
                      ) -> tuple[torch.Tensor, ...]:
    """A decode layer's first half up to attention, one call: ``s = x + delta`` (``x`` when delta
    is None), ``qkv = rms_norm(s) @ W^T`` (``qkv_w``: a ``PackedMat`` handle,
    :meth:`monobatch.quant.packed.PackedPart.mat`), then :func:`rope_qk_` of q's and k's heads ->
    ``(s, q, k, v)``: float32 ``[T, D]``, ``[T, n_heads, hd]``, ``[T, n_kv, hd]`` twice (views of
    qkv). The same functions in the same order as :func:`add_rms_norm`,
    :func:`monobatch.kernels.quant_cpu.gemm` and :func:`rope_qk_` called one by one: the same bits."""
    s, q, k, v = quant_cpu.module().add_norm_qkv_rope(x, delta, weight, eps, qkv_w, cos, sin, n_heads, n_kv, head_dim)
    return s, q, k, v


def o_add_norm_mlp(x: torch.Tensor, attn_out: torch.Tensor, o_w, weight: torch.Tensor, eps: float, gate_up_w,
                   down_w) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode layer's second half, one call: ``s = x + attn_out @ Wo^T`` (attn_out ``[T, H*hd]``
    or ``[T, H, hd]``), ``h = rms_norm(s)``,
    ``y = silu_mul(h @ Wgu^T) @ Wdown^T`` -> ``(s, y)`` float32 ``[T, D]`` each (weights as
    ``PackedMat`` handles); the bits of the separate calls."""
    s, y = quant_cpu.module().o_add_norm_mlp(x, attn_out, o_w, weight, eps, gate_up_w, down_w)
    return s, y
