"""The Llama-family decoder: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

One batch-native forward: ``forward(batch, kv) -> logits[R, vocab]`` over a flat StepBatch whose
tokens may come from many sequences (prefill chunks and decode tokens mixed). Attention reads and
writes the KV cache only through :class:`monobatch.kv.store.KvStore`.

Shape letters: T tokens in the step, R rows that want logits, D hidden size, H query heads,
K KV heads, hd head dim, F FFN size, V vocab.

Weights are held packed (nano-vllm style): ``qkv_proj`` = cat(q, k, v) rows and
``gate_up_proj`` = cat(gate, up) rows, so a layer is four GEMMs. The loader fills them from HF
names (:data:`PACKED`), whatever the file format.

The residual stream is carried as (residual, pending delta), as in vLLM's Llama: a sublayer's
output is not added where it is made but by the norm that follows it (post_attention_layernorm,
the next layer's input_layernorm, the final norm), :meth:`RMSNorm.add_forward`, which is one
fused kernel on CUDA (:func:`monobatch.kernels.fused.add_rms_norm`). The torch path runs the same
ops in the same order as the plain pre-norm block (an add in the model dtype, then the norm), so
its results are bitwise those of ``x = x + sublayer(norm(x))``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from monobatch.engine.batch import StepBatch
from monobatch.kernels import fused, gemv
from monobatch.kv.store import KvStore
from monobatch.models.args import ModelArgs
from monobatch.models.rope import RotaryEmbedding, apply_rope, rope_inv_freq

#: HF tensor suffix -> (packed parameter, index of its slice). Read by the loaders.
PACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def rowwise(tile: int, fn, *xs: torch.Tensor):
    """Apply a row-wise ``fn`` to ``xs`` (each ``[T, ...]``), in fixed tiles when ``tile`` > 0.

    Deterministic mode (``tile`` = N): the rows are zero-padded to a multiple of N and ``fn`` runs
    on ``[N, ...]`` tiles only, so every GEMM, reduction and vectorised activation has the same
    shape whatever the batch holds, and a row's result depends on that row alone (a 1-row GEMM
    differs bitwise from the same row inside a larger one; see the ADR). ``tile`` 0 is one call.

    Returns:
        ``fn``'s output (a tensor or a tuple of tensors), ``T`` rows each.
    """
    T = xs[0].shape[0]
    if tile <= 0 or T == 0:
        return fn(*xs)
    pad = -T % tile
    if pad:
        xs = tuple(torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) for x in xs)
    tiles = [fn(*(x[i:i + tile] for x in xs)) for i in range(0, T + pad, tile)]
    if isinstance(tiles[0], tuple):
        return tuple(torch.cat(parts)[:T] for parts in zip(*tiles))
    return torch.cat(tiles)[:T]


def _param(*shape: int) -> nn.Parameter:
    # torch.empty: no random init; the loader fills every parameter.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b), weight ``[out, in]``; no init (the loader fills it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, in]`` -> ``[T, out]`` (few-row inputs on CUDA: :func:`monobatch.kernels.gemv.linear`)."""
        return gemv.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019), computed in float32 like HF's LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., dim]`` -> same shape and dtype (one fused kernel on CUDA: :mod:`monobatch.kernels.fused`)."""
        if fused.enabled(x):
            return fused.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add then norm: x and delta ``[..., dim]`` (one dtype) -> ``(s, norm(s))`` with
        ``s = x + delta`` in that dtype; one fused kernel on CUDA (:func:`fused.add_rms_norm`,
        new tensors, ``x`` is not written)."""
        if fused.enabled(x):
            return fused.add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self.forward(x)


class Attention(nn.Module):
    """Grouped-query attention's projections: packed QKV, optional qkv bias (Qwen2) and q/k norm
    (Qwen3). The attention itself runs in the KV store (:meth:`KvStore.attend`)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.hd = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.q_size, self.kv_size = self.n_heads * self.hd, self.n_kv * self.hd
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.attention_bias)
        self.o_proj = Linear(self.q_size, args.hidden_size)
        self.q_norm = RMSNorm(self.hd, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.hd, args.rms_norm_eps) if args.qk_norm else None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x ``[T, D]`` (normed), cos/sin ``[T, hd]`` -> q ``[T, H, hd]``, k and v ``[T, K, hd]``
        (norms and RoPE applied). On CUDA without q/k norm, q and k are rotated in one launch
        straight from the packed projection (:func:`fused.rope_qk`); v is a view of it."""
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, (H + 2K) hd)
        if self.q_norm is None and fused.enabled(qkv):
            q, k = fused.rope_qk(qkv, self.n_heads, self.n_kv, self.hd, cos, sin)
            return q, k, qkv[:, self.q_size + self.kv_size:].view(T, self.n_kv, self.hd)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.n_heads, self.hd)  # (T, H, hd)
        k = k.view(T, self.n_kv, self.hd)  # (T, K, hd)
        v = v.reshape(T, self.n_kv, self.hd)  # (T, K, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x)), gate and up packed."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.ffn = args.intermediate_size
        self.gate_up_proj = Linear(args.hidden_size, 2 * self.ffn)
        self.down_proj = Linear(self.ffn, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, D]`` -> ``[T, D]``."""
        gate_up = self.gate_up_proj(x)  # (T, 2F)
        if fused.enabled(gate_up):  # the SiLU inside the down GEMV where it runs, else one fused kernel
            return gemv.gated_linear(gate_up, self.down_proj.weight, self.down_proj.bias)
        gate, up = gate_up.split(self.ffn, dim=-1)  # (T, F) each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: two residual lines, each add folded into the norm after it
    (see the module docstring)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, residual: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: StepBatch, kv: KvStore) -> tuple[torch.Tensor, torch.Tensor]:
        """One block on the carried residual stream.

        Args:
            residual: ``[T, D]``, the stream before the previous layer's MLP output is added.
            delta: ``[T, D]``, that MLP output, still to add (None at the first layer, whose
                ``residual`` is the embeddings).
            cos, sin: ``[T, hd]``.

        Returns:
            ``(residual, delta)`` ``[T, D]`` each: the stream after this layer's attention line
            and this layer's MLP output, to be added by the next norm. Everything but attention
            is row-wise (tiled in deterministic mode, see :func:`rowwise`).
        """
        attn, tile = self.self_attn, batch.row_tile
        if delta is None:
            q, k, v = rowwise(tile, lambda x, c, s: attn.project(self.input_layernorm(x), c, s), residual, cos, sin)
        else:
            residual, q, k, v = rowwise(tile, self._add_project, residual, delta, cos, sin)
        out = kv.attend(attn.layer, q, k, v, batch)  # (T, H, hd)
        return rowwise(tile, self._attn_add_mlp, residual, out.flatten(1))

    def _add_project(self, residual: torch.Tensor, delta: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The previous MLP line's add, input_layernorm and the q/k/v projection: residual and
        delta ``[T, D]`` -> (residual + delta ``[T, D]``, q ``[T, H, hd]``, k, v ``[T, K, hd]``)."""
        residual, h = self.input_layernorm.add_forward(residual, delta)
        return (residual, *self.self_attn.project(h, cos, sin))

    def _attn_add_mlp(self, residual: torch.Tensor, attn_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, the attention line's add, post_attention_layernorm and the MLP: residual
        ``[T, D]``, attn_out ``[T, H*hd]`` -> (residual + o_proj(attn_out), MLP output), ``[T, D]`` each."""
        residual, h = self.post_attention_layernorm.add_forward(residual, self.self_attn.o_proj(attn_out))
        return residual, self.mlp(h)


class LlamaModel(nn.Module):
    """Embeddings -> decoder layers -> final norm -> LM head (tied to the embeddings when the
    checkpoint has no separate output matrix)."""

    def __init__(self, args: ModelArgs, freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = _param(args.vocab_size, args.hidden_size)  # (V, D)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else Linear(args.hidden_size, args.vocab_size)
        inv_freq, scale = rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling,
                                        args.max_position_embeddings, freq_factors)
        self.rope = RotaryEmbedding(inv_freq, scale)

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.embed_tokens.device

    @property
    def dtype(self) -> torch.dtype:
        """Compute (and KV) dtype."""
        return self.embed_tokens.dtype

    def to_device(self, device: torch.device, dtype: torch.dtype) -> "LlamaModel":
        """Move and cast the weights; the RoPE table stays float32."""
        self.to(device=device, dtype=dtype)
        self.rope.to(device)
        return self

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: KvStore) -> torch.Tensor:
        """Run one step.

        Args:
            batch: T flat tokens of any number of sequences (see :class:`StepBatch`).
            kv: the KV cache; ``kv.prepare(batch)`` must have been called.

        Returns:
            ``[R, V]`` float32 logits for ``batch.logit_rows``, in their order.
        """
        x = F.embedding(batch.token_ids, self.embed_tokens)  # (T, D)
        cos, sin = self.rope.cos_sin(batch.positions, x.dtype, batch.position_bound)  # (T, hd) each
        residual, delta = x, None
        for layer in self.layers:
            residual, delta = layer(residual, delta, cos, sin, batch, kv)  # (T, D) each
        head = self.embed_tokens if self.lm_head is None else self.lm_head.weight
        # (R, D) -> (R, V): only rows that want logits; the last MLP output is added to those rows only
        if batch.logit_rows.shape[0] != batch.num_tokens:  # else every row, in order (StepBatch's rows ascend)
            rows = batch.logit_rows
            residual, delta = residual[rows], None if delta is None else delta[rows]
        if delta is None:  # no layers
            return rowwise(batch.row_tile, lambda x: self._logits(self.norm(x), head), residual)
        return rowwise(batch.row_tile, lambda r, d: self._logits(self.norm.add_forward(r, d)[1], head),
                       residual, delta)

    def _logits(self, x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """``x @ head.T`` as float32 ``[R, V]``: with 16-bit weights on CUDA the GEMM writes float32
        directly (:func:`monobatch.kernels.gemv.linear` with ``out_dtype``), so logits are not
        rounded to bfloat16 (which ties tokens whose logits differ by less than ~0.1)."""
        return gemv.linear(x, head, out_dtype=torch.float32)
