"""The Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Only what this family states; the layers are :mod:`monobatch.models.layers`. One batch-native
forward: ``forward(batch, kv) -> logits[R, vocab]`` over a flat StepBatch whose tokens may come
from many sequences (prefill chunks and decode tokens mixed).

Block: pre-norm, two residual lines (``x += attn(input_layernorm(x))``, ``x += mlp(
post_attention_layernorm(x))``), each add folded into the norm after it (see
:mod:`monobatch.models.layers`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from monobatch.batch import StepBatch
from monobatch.kv.store import KvStore
from monobatch.models.args import ModelArgs
from monobatch.models.layers import Attention, DecoderModel, GatedMLP, RMSNorm, make_rope, rowwise

log = logging.getLogger(__name__)

Args = ModelArgs
#: GGUF ``general.architecture`` values of this family -> HF ``model_type``.
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


def adjust_config(config: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Family rules on an HF config's ModelArgs fields (``kwargs``, changed in place): Qwen2's
    qkv bias; a sliding window smaller than the context caps the context (these families' windows
    are not run; within the window sliding attention equals full attention)."""
    if config.get("model_type") == "qwen2":
        kwargs.setdefault("attention_bias", True)
    window = config.get("sliding_window")
    uses_window = config.get("use_sliding_window", config.get("model_type") not in ("qwen2", "qwen3"))  # HF defaults
    context = kwargs.get("max_position_embeddings", ModelArgs.field_default("max_position_embeddings"))
    if window and uses_window and window < context:
        if kwargs.get("rope_scaling") and not kwargs["rope_scaling"].get("original_max_position_embeddings"):
            kwargs["rope_scaling"] = {**kwargs["rope_scaling"], "original_max_position_embeddings": context}
        log.warning("sliding-window attention (%d tokens) is not implemented: context capped to %d", window, window)
        kwargs["max_position_embeddings"] = int(window)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: two residual lines, each add folded into the norm after it."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = GatedMLP(args, F.silu)

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
        tile, pad = batch.row_tile, batch.row_pad
        # where the KV store takes this step's keys through the fused RoPE (one launch fewer a layer)
        store = None if tile else kv.store_slots(self.self_attn.layer)
        residual, q, k, v = rowwise(tile, self._add_project, residual, cos, sin,
                                    *(() if delta is None else (delta,)), pad=pad, store=store)
        out = kv.attend(self.self_attn.layer, q, k, v, batch)  # (T, H, hd); k, v None: already stored
        return rowwise(tile, self._attn_add_mlp, residual, out, pad=pad)

    def cpu_routes(self) -> tuple[tuple, tuple] | None:
        """This block's two fused CPU routes' calls (:class:`~monobatch.models.layers.CpuRoute`:
        the norm, projections, RoPE and SwiGLU of :meth:`forward` in two C++ calls, every row
        alone), or None where one does not apply."""
        attn, mlp = self.self_attn, self.mlp
        project = attn.cpu_route.resolve(attn._cpu_project, self.input_layernorm)
        ffn = mlp.cpu_route.resolve(mlp._cpu_forward, attn.o_proj, self.post_attention_layernorm)
        return (project, ffn) if project and ffn else None

    def rows_independent(self) -> bool:
        """Whether this block computes each row alone by construction (both fused CPU routes
        apply: :meth:`DecoderModel.rows_independent`)."""
        return self.cpu_routes() is not None

    def chain_args(self, kv: KvStore) -> tuple | None:
        """This block's arguments of the C++ ``LayerChain.add`` (:meth:`DecoderModel.layer_chain`):
        its two fused CPU routes' fixed arguments around ``kv``'s attention inputs of the layer
        (:meth:`KvStore.chain_layer`) — the calls :meth:`forward` makes, bound once. None where
        a route or the store's C++ attention does not apply."""
        routes, where = self.cpu_routes(), kv.chain_layer(self.self_attn.layer)
        if routes is None or where is None:
            return None
        return (*routes[0][1:], *where, *routes[1][1:])

    def _add_project(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     delta: torch.Tensor | None = None, store: tuple | None = None) -> tuple[torch.Tensor, ...]:
        """The previous MLP line's add (none at the first layer), input_layernorm and the q/k/v
        projection: residual and delta ``[T, D]`` -> (residual + delta ``[T, D]``, q ``[T, H, hd]``,
        k, v ``[T, K, hd]``, None where stored at ``store``: :meth:`Attention.project`)."""
        return self.self_attn.add_norm_project(self.input_layernorm, residual, delta, cos, sin, store)

    def _attn_add_mlp(self, residual: torch.Tensor, attn_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, the attention line's add, post_attention_layernorm and the MLP: residual
        ``[T, D]``, attn_out ``[T, H, hd]`` -> (residual + o_proj(attn_out), MLP output), ``[T, D]`` each."""
        return self.mlp.attn_add_forward(self.self_attn.o_proj, self.post_attention_layernorm, residual, attn_out)


class Model(DecoderModel):
    """Embeddings -> decoder layers -> final norm -> LM head.

    Args:
        args: shapes and options.
        freq_factors: GGUF's ``rope_freqs.weight`` ``[hd/2]`` (llama3 scaling as divisors), or None.
    """

    def __init__(self, args: ModelArgs, freq_factors: torch.Tensor | None = None) -> None:
        super().__init__(args)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.rope = make_rope(args, args.rope_theta, args.rope_scaling, freq_factors)
        self.ropes = (self.rope,)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: KvStore) -> torch.Tensor:
        """Run one step.

        Args:
            batch: T flat tokens of any number of sequences (see :class:`StepBatch`).
            kv: the KV cache; ``kv.prepare(batch)`` must have been called.

        Returns:
            ``[R, V]`` float32 logits for ``batch.logit_rows``, in their order.
        """
        x = self.embed(batch.token_ids)  # (T, D)
        cos, sin = self.rope.cos_sin(batch.positions, x.dtype, batch.position_bound)  # (T, hd) each
        chained = self.chained(batch, kv, x, cos, sin)  # CPU decode steps: the loop below in one C++ call
        if chained is not None:
            return self.logits(batch, *chained)
        residual, delta = x, None
        for layer in self.layers:
            residual, delta = layer(residual, delta, cos, sin, batch, kv)  # (T, D) each
        return self.logits(batch, residual, delta)
