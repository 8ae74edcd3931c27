"""Gemma 3 (text): Google's Gemma 3 decoders (270M .. 27B; HF ``gemma3_text``, GGUF ``gemma3``).

What differs from the Llama family (:mod:`monobatch.models.llama`):

* the embeddings are scaled by ``sqrt(hidden_size)`` (in the model dtype, as HF);
* Gemma's RMSNorm multiplies by ``1 + weight``: the norms hold ``1 + weight`` (GGUF files store
  it so; :func:`hf_tensor` adds the 1 to an HF checkpoint's), so they are the shared
  :class:`~monobatch.models.layers.RMSNorm`;
* four norms a block — input, post-attention, pre-feed-forward, post-feed-forward — and q/k norm;
* GeGLU (tanh GELU) feed-forward;
* the softmax scale is ``query_pre_attn_scalar ** -0.5`` (q is rescaled when it is not
  ``1/sqrt(head_dim)``);
* local (sliding-window) layers and global layers: every ``sliding_window_pattern``-th layer is
  global (HF's ``layer_types``), local layers attend to the last ``sliding_window`` positions
  (the KV store runs the window: :mod:`monobatch.kv.store`, ADR 0005) and rotate with their own
  RoPE base (``rope_local_base_freq``, 10,000), global layers with ``rope_theta`` and the
  config's RoPE scaling;
* tied embeddings.

Block (HF's Gemma3DecoderLayer), with each add folded into the norm after it as in
:mod:`monobatch.models.layers`::

    x = x + post_attention_layernorm(attn(input_layernorm(x)))
    x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from monobatch.batch import StepBatch
from monobatch.errors import UnsupportedModelError
from monobatch.kv.store import KvStore
from monobatch.models.args import ModelArgs
from monobatch.models.layers import (Attention, DecoderModel, GatedMLP, RMSNorm, fused_cpu_linears, gelu_tanh,
                                     make_rope, plain_norm, rowwise)

#: GGUF ``general.architecture`` values of this family -> HF ``model_type``.
GGUF_ARCHITECTURES = {"gemma3": "gemma3_text"}
#: llama.cpp's names of Gemma's four block norms (the rest are the Llama family's).
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
SLIDING, FULL = "sliding_attention", "full_attention"
#: Gemma 3's chat template (google/gemma-3-*-it ``chat_template``, text parts), for checkpoints
#: without one (the 270M GGUF is a base model): ``<start_of_turn>user`` / ``model`` turns, a
#: system message folded into the first user turn, BOS from the template (the tokenizer does not
#: add a second one). ``<end_of_turn>`` (id 106) is an end-of-generation token of the vocabulary.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}"
    "{%- else -%}{{ raise_exception('Invalid content type') }}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


@dataclass(slots=True)
class Args(ModelArgs):
    """Gemma 3's hyper-parameters: :class:`ModelArgs` plus the fields of HF's Gemma3TextConfig.

    Attributes:
        query_pre_attn_scalar: the softmax scale is its inverse square root.
        sliding_window: tokens a local layer sees (its own included).
        sliding_window_pattern: every N-th layer is global (when ``layer_types`` is not given).
        layer_types: per layer ``sliding_attention`` or ``full_attention`` (None: from the pattern).
        rope_local_base_freq: the RoPE base of local layers (global layers use ``rope_theta``).
    """

    model_type: str = "gemma3_text"
    hidden_size: int = 640
    num_hidden_layers: int = 18
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    head_dim: int = 256
    intermediate_size: int = 2048
    vocab_size: int = 262144
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    qk_norm: bool = True
    hidden_act: str = "gelu_pytorch_tanh"
    query_pre_attn_scalar: float = 256.0
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    layer_types: tuple[str, ...] | None = None
    rope_local_base_freq: float = 10_000.0

    ACTIVATIONS: ClassVar[tuple[str, ...]] = ("gelu_pytorch_tanh", "gelu_tanh")

    def __post_init__(self) -> None:
        ModelArgs.__post_init__(self)
        self.qk_norm = True
        if self.layer_types is None:
            p = self.sliding_window_pattern
            self.layer_types = tuple(FULL if (i + 1) % p == 0 else SLIDING for i in range(self.num_hidden_layers))
        self.layer_types = tuple(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {SLIDING, FULL}:
            raise UnsupportedModelError(f"layer_types must name {self.num_hidden_layers} layers, each "
                                        f"{SLIDING!r} or {FULL!r}")
        if self.sliding_window < 1:
            raise UnsupportedModelError("sliding_window must be >= 1")

    def layer_windows(self) -> tuple[int, ...]:
        """``sliding_window`` for local layers, 0 (every position) for global ones."""
        return tuple(self.sliding_window if t == SLIDING else 0 for t in self.layer_types)

    def num_parameters(self) -> int:
        """:meth:`ModelArgs.num_parameters` plus the two extra norms of every block."""
        return ModelArgs.num_parameters(self) + 2 * self.num_hidden_layers * self.hidden_size


def adjust_config(config: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """HF Gemma3TextConfig -> :class:`Args` fields (``kwargs``, changed in place): the activation
    is ``hidden_activation``; RoPE comes as ``rope_theta`` / ``rope_local_base_freq`` /
    ``rope_scaling`` or, from transformers 5, as ``rope_parameters`` keyed by layer type.

    Raises:
        UnsupportedModelError: attention logit soft-capping (not in Gemma 3; the KV store's
            attention has no soft-cap), or a final logit soft-cap.
    """
    if config.get("hidden_activation"):
        kwargs["hidden_act"] = config["hidden_activation"]
    if config.get("attn_logit_softcapping") or config.get("final_logit_softcapping"):
        raise UnsupportedModelError("logit soft-capping is not supported (Gemma 3 has none)")
    if config.get("_sliding_window_pattern") and "sliding_window_pattern" not in kwargs:
        kwargs["sliding_window_pattern"] = int(config["_sliding_window_pattern"])
    rope = config.get("rope_parameters") or {}
    if isinstance(rope.get(FULL), dict):  # transformers 5: one dict per layer type
        full, local = dict(rope[FULL]), dict(rope.get(SLIDING) or {})
        kwargs["rope_theta"] = full.pop("rope_theta", kwargs.get("rope_theta", Args.field_default("rope_theta")))
        kwargs["rope_scaling"] = full if full.get("rope_type", "default") != "default" else None
        kwargs["rope_local_base_freq"] = local.get("rope_theta", Args.field_default("rope_local_base_freq"))
    if kwargs.get("sliding_window") is None:
        kwargs.pop("sliding_window", None)


def gguf_args(field: Callable[..., Any], arch: str) -> dict[str, Any]:
    """:class:`Args` fields from GGUF metadata beyond the shared ones (llama.cpp's rules for
    ``gemma3``: the window from ``gemma3.attention.sliding_window``, local layers at RoPE base
    10,000, every 6th layer global, the softmax scale ``1/sqrt(head_dim)`` except for the 27B
    (62 layers: ``1/sqrt(hidden / heads)``)).

    Args:
        field: ``field(key, default=None)``, a metadata value.
        arch: the file's ``general.architecture``.
    """
    layers, hidden = int(field(f"{arch}.block_count")), int(field(f"{arch}.embedding_length"))
    heads = int(field(f"{arch}.attention.head_count"))
    head_dim = int(field(f"{arch}.attention.key_length", hidden // heads))
    out: dict[str, Any] = {"hidden_act": "gelu_pytorch_tanh",
                           "sliding_window": int(field(f"{arch}.attention.sliding_window", 512)),
                           "query_pre_attn_scalar": float(hidden // heads if layers == 62 else head_dim)}
    pattern = field(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)):  # per layer: True = sliding
        out["layer_types"] = tuple(SLIDING if p else FULL for p in pattern)
    elif pattern:
        out["sliding_window_pattern"] = int(pattern)
    return out


def hf_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """An HF checkpoint's tensor as the model holds it: Gemma's norms hold ``1 + weight``
    (added in float32, as HF's ``1.0 + weight.float()``)."""
    return tensor.float() + 1.0 if name.endswith("norm.weight") else tensor


class DecoderLayer(nn.Module):
    """One Gemma 3 block (local or global, see the module docstring)."""

    def __init__(self, args: Args, layer: int) -> None:
        super().__init__()
        d, eps = args.hidden_size, args.rms_norm_eps
        self.sliding = args.layer_types[layer] == SLIDING
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = Attention(args, layer, q_scale=(args.head_dim / args.query_pre_attn_scalar) ** 0.5)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.pre_feedforward_layernorm = RMSNorm(d, eps)
        self.mlp = GatedMLP(args, gelu_tanh)
        self.post_feedforward_layernorm = RMSNorm(d, eps)

    def forward(self, residual: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: StepBatch, kv: KvStore) -> tuple[torch.Tensor, torch.Tensor]:
        """One block on the carried residual stream.

        Args:
            residual: ``[T, D]``, the stream before the previous block's feed-forward line is added.
            delta: ``[T, D]``, that line's output (post-normed), still to add (None at the first layer).
            cos, sin: ``[T, hd]`` of this layer's RoPE (local or global).

        Returns:
            ``(residual, delta)`` ``[T, D]`` each: the stream after this block's attention line and
            its feed-forward line's output, to be added by the next norm.
        """
        tile, pad = batch.row_tile, batch.row_pad  # everything but attention is row-wise (tiled in deterministic mode)
        q, k, v, residual = rowwise(tile, self._project, residual, cos, sin, *(() if delta is None else (delta,)),
                                    pad=pad)
        out = kv.attend(self.self_attn.layer, q, k, v, batch)  # (T, H, hd)
        return rowwise(tile, self._attn_add_mlp, residual, out.flatten(1), pad=pad)

    def rows_independent(self) -> bool:
        """Whether this block computes each row alone by construction
        (:meth:`DecoderModel.rows_independent`): its four products packed on the CPU (the int16
        GEMV), its six norms the C++ RMSNorm, GeGLU the C++ op; RoPE and the query scale are
        elementwise products and sums, each correctly rounded wherever the element lies."""
        attn = self.self_attn
        norms = (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                 self.post_feedforward_layernorm, attn.q_norm, attn.k_norm)
        return (self.mlp.act is gelu_tanh and all(n is None or plain_norm(n) for n in norms)
                and fused_cpu_linears(attn.qkv_proj, attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj))

    def _project(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 delta: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """(The previous block's add,) input_layernorm and q/k/v: residual (and delta) ``[T, D]``
        -> q ``[T, H, hd]``, k, v ``[T, K, hd]``, the stream ``[T, D]``."""
        if delta is None:
            h = self.input_layernorm(residual)
        else:
            residual, h = self.input_layernorm.add_forward(residual, delta)
        return (*self.self_attn.project(h, cos, sin), residual)

    def _attn_add_mlp(self, residual: torch.Tensor, attn_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, post_attention_layernorm, the add, pre_feedforward_layernorm, the GeGLU and
        post_feedforward_layernorm: residual ``[T, D]``, attn_out ``[T, H*hd]`` -> (the stream
        after the attention line, the feed-forward line's output), ``[T, D]`` each."""
        a = self.post_attention_layernorm(self.self_attn.o_proj(attn_out))
        residual, h = self.pre_feedforward_layernorm.add_forward(residual, a)
        return residual, self.post_feedforward_layernorm(self.mlp(h))


class Model(DecoderModel):
    """Scaled embeddings -> Gemma 3 blocks -> final norm -> tied LM head.

    Args:
        args: :class:`Args`.
        freq_factors: unused (GGUF's llama3 RoPE factors; Gemma files have none).
    """

    def __init__(self, args: Args, freq_factors: torch.Tensor | None = None) -> None:
        super().__init__(args)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.rope = make_rope(args, args.rope_theta, args.rope_scaling)  # global layers
        self.rope_local = make_rope(args, args.rope_local_base_freq, None)  # sliding layers
        self.ropes = (self.rope, self.rope_local)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: KvStore) -> torch.Tensor:
        """Run one step.

        Args:
            batch: T flat tokens of any number of sequences (see :class:`StepBatch`).
            kv: the KV cache (windows per layer from :meth:`Args.layer_windows`);
                ``kv.prepare(batch)`` must have been called.

        Returns:
            ``[R, V]`` float32 logits for ``batch.logit_rows``, in their order.
        """
        x = self.embed(batch.token_ids)  # (T, D)
        x = x * torch.tensor(self.args.hidden_size ** 0.5, dtype=x.dtype)  # HF: the scale in the weights' dtype
        pos, bound = batch.positions, batch.position_bound
        rope = {False: self.rope.cos_sin(pos, x.dtype, bound), True: self.rope_local.cos_sin(pos, x.dtype, bound)}
        residual, delta = x, None
        for layer in self.layers:
            residual, delta = layer(residual, delta, *rope[layer.sliding], batch, kv)  # (T, D) each
        return self.logits(batch, residual, delta)
