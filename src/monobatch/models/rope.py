"""Rotary position embeddings (RoPE, Su et al. 2021) with HF's scaling variants.

The rotation is HF's ``rotate_half`` layout (first half / second half of each head), which is
what HF checkpoints use and what our GGUF loader restores by undoing llama.cpp's Q/K permutation.
Scaling formulas follow transformers' ``modeling_rope_utils`` (linear; llama3 from Meta's
Llama 3.1 release; YaRN, Peng et al. 2023).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from monobatch.errors import UnsupportedModelError
from monobatch.kernels import fused


def _yarn(inv_freq: torch.Tensor, dim: int, base: float, cfg: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    factor = float(cfg["factor"])
    orig = int(cfg.get("original_max_position_embeddings") or max_pos)
    beta_fast, beta_slow = float(cfg.get("beta_fast") or 32), float(cfg.get("beta_slow") or 1)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = cfg.get("attention_factor")
    if attention_factor is None:
        if cfg.get("mscale") and cfg.get("mscale_all_dim"):
            attention_factor = mscale(factor, cfg["mscale"]) / mscale(factor, cfg["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1.0 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attention_factor)


def _llama3(inv_freq: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    factor = float(cfg["factor"])
    low_ff, high_ff = float(cfg.get("low_freq_factor", 1.0)), float(cfg.get("high_freq_factor", 4.0))
    old_ctx = float(cfg["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low_ff, old_ctx / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int,
    freq_factors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` float32 and the attention (cos/sin) scale.

    ``freq_factors`` is GGUF's ``rope_freqs.weight`` (llama3 models store the scaling as
    per-frequency divisors, llama.cpp convention); it is applied instead of ``scaling``.

    Raises:
        UnsupportedModelError: a ``rope_type`` other than default, linear, llama3 and yarn
            (dynamic NTK and longrope are refused rather than silently ignored).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if freq_factors is not None:
        return inv_freq / freq_factors.float(), 1.0
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling, max_position_embeddings)
    raise UnsupportedModelError(f"unsupported rope scaling {kind!r} (monobatch implements linear, llama3, yarn)")


#: Positions whose cos/sin :meth:`RotaryEmbedding.build_table` computes at a time: the formula's
#: float32 temporaries stay ~1 MiB (over all 8,192 positions of the bundled model at once they
#: were ~15 MiB beside its 4 MiB table, left on CPU as freed heap; issue 17's RSS). A multiple of
#: 16 rows, so each chunk's elementwise kernels split their vectors as the whole table's would
#: (the same values either way: tests/test_rope.py).
TABLE_CHUNK = 1024


class RotaryEmbedding:
    """cos/sin for positions: gathered from a table built once (:meth:`build_table`), or computed
    on the fly from ``inv_freq`` for positions past it (no length cap).

    The table makes a step's RoPE input one gather instead of ~10 small kernels (about 15 µs of
    a B=1 decode step on an H200). Its values are the on-the-fly formula's, element for element.

    Args:
        inv_freq: ``[head_dim // 2]`` float32 from :func:`rope_inv_freq`.
        attention_scale: multiplies cos and sin (YaRN's mscale; 1.0 otherwise).

    Attributes:
        table: None, or ``[L, 2, head_dim]`` (cos, sin) of positions ``0 .. L-1`` in the compute
            dtype, on ``inv_freq``'s device.
        limit: the length a growing table (``build_table(..., grow=True)``) may reach; 0 when
            the table does not grow.
    """

    def __init__(self, inv_freq: torch.Tensor, attention_scale: float = 1.0) -> None:
        self.inv_freq = inv_freq
        self.attention_scale = attention_scale
        self.table: torch.Tensor | None = None
        self.limit = 0

    def to(self, device: torch.device) -> "RotaryEmbedding":
        """Move the frequencies (and the table, if built) to ``device``."""
        self.inv_freq = self.inv_freq.to(device)
        if self.table is not None:
            self.table = self.table.to(device)
        return self

    def build_table(self, length: int, dtype: torch.dtype, grow: bool = False) -> None:
        """Precompute cos/sin of positions ``0 .. length-1`` in ``dtype`` (``2 * length * head_dim``
        elements). A table already as long, in that dtype, is kept; otherwise it is replaced
        (a CUDA graph that read the old one keeps a reference to it).

        ``grow``: build only the first :data:`TABLE_CHUNK` positions now; :meth:`cos_sin` extends
        the table a chunk at a time as positions reach it, up to ``length`` (the same values:
        chunks start at the same positions). Only where nothing holds on to the table (no CUDA
        graph): a run that never passes a few hundred positions then keeps a 0.5 MiB table, not
        the whole context's (4 MiB for the bundled model; issue 17's RSS).
        """
        self.limit = max(self.limit, length) if grow else self.limit  # engines may share the model: never shrunk
        first = min(length, TABLE_CHUNK) if grow else length
        t = self.table
        if t is not None and t.shape[0] >= first and t.dtype == dtype:
            return
        self.table = None if t is None or t.dtype != dtype else t
        self._extend(first, dtype)

    def _extend(self, length: int, dtype: torch.dtype) -> None:
        """Replace the table by one of ``length`` rows: the old rows copied, the new ones computed
        a chunk of :data:`TABLE_CHUNK` positions at a time (bounded temporaries)."""
        old = self.table
        done = 0 if old is None else min(old.shape[0], length) // TABLE_CHUNK * TABLE_CHUNK  # whole chunks kept
        device = self.inv_freq.device
        table = torch.empty(length, 2, self.inv_freq.shape[0] * 2, dtype=dtype, device=device)
        if done:
            table[:done] = old[:done]
        for lo in range(done, length, TABLE_CHUNK):  # chunks start where the whole table's do
            cos, sin = self._compute(torch.arange(lo, min(lo + TABLE_CHUNK, length), device=device), dtype)
            table[lo:lo + TABLE_CHUNK, 0] = cos
            table[lo:lo + TABLE_CHUNK, 1] = sin
        self.table = table

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, bound: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]`` int64 -> (cos, sin) each ``[T, head_dim]`` in ``dtype`` (computed in
        float32, as HF). ``bound``: every position is below it (known on the host; None: unknown).
        Within the table they are views of one gather (row stride ``2 * head_dim``)."""
        t = self.table
        if t is not None and bound is not None and t.shape[0] < bound <= self.limit and t.dtype == dtype:
            self._extend(min(-(-bound // TABLE_CHUNK) * TABLE_CHUNK, self.limit), dtype)  # a growing table
            t = self.table
        if t is not None and bound is not None and bound <= t.shape[0] and t.dtype == dtype \
                and t.device == positions.device:
            rows = t.index_select(0, positions)  # (T, 2, hd)
            return rows[:, 0], rows[:, 1]
        return self._compute(positions, dtype)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
        return (emb.cos() * self.attention_scale).to(dtype), (emb.sin() * self.attention_scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by cos/sin ``[T, head_dim]`` (HF rotate_half layout;
    one fused kernel on CUDA: :mod:`monobatch.kernels.fused`)."""
    if fused.enabled(x):
        return fused.rope(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
