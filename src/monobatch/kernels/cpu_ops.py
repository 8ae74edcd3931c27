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
import os

import torch

from monobatch.kernels import quant_cpu

_ON = os.environ.get("MONOBATCH_CPU_KERNELS", "1") != "0"


@functools.cache
def _available() -> bool:
    return _ON and quant_cpu.available()


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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              write: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor, block_size: int, window: int,
              out: torch.Tensor) -> torch.Tensor:
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
        out: float32 ``[T, H, hd]`` contiguous; the rows named in ``rows`` are written.

    Returns:
        ``out``. Softmax scale ``1/sqrt(hd)``; each row alone (its query and the keys it sees).

    Raises:
        RuntimeError: shapes, dtypes or indices out of range (checked before anything is written
            past the new K/V).
    """
    quant_cpu.module().attention(q, k, v, k_cache, v_cache, write, rows, tables, block_size, window, out)
    return out
