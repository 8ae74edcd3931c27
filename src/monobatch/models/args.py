"""Model hyper-parameters shared by every family, read from HF config.json or GGUF metadata.

A family with more (Gemma 3) subclasses :class:`ModelArgs`; :meth:`ModelArgs.from_dict` builds
the family's class through the registry (:mod:`monobatch.models.registry`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from monobatch.errors import UnsupportedModelError
from monobatch.models import registry


@dataclass(slots=True)
class ModelArgs:
    """Shapes and options of a decoder (names follow HF's LlamaConfig).

    ``attention_bias`` is Qwen2's q/k/v bias; ``qk_norm`` is Qwen3's per-head RMSNorm on q and k.
    ``rope_scaling`` is HF's dict (``rope_type``: linear | llama3 | yarn) or None.
    """

    model_type: str = "llama"
    hidden_size: int = 576
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads
    intermediate_size: int = 1536
    vocab_size: int = 49152
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-6  # HF LlamaConfig's default
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    extra: dict[str, Any] = field(default_factory=dict)

    #: ``hidden_act`` values the family's MLP runs.
    ACTIVATIONS: ClassVar[tuple[str, ...]] = ("silu",)

    def __post_init__(self) -> None:
        self.model_type = registry.canonical(self.model_type)
        if self.hidden_act not in self.ACTIVATIONS:
            raise UnsupportedModelError(f"unsupported activation {self.hidden_act!r} (only {', '.join(self.ACTIVATIONS)})")
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.model_type == "qwen3":
            self.qk_norm = True

    @classmethod
    def field_default(cls, name: str) -> Any:
        """A field's default value (a slots class has no class attribute to read it from)."""
        return next(f.default for f in dataclasses.fields(cls) if f.name == name)

    @staticmethod
    def from_dict(config: Mapping[str, Any]) -> "ModelArgs":
        """Build the family's args (:mod:`monobatch.models.registry`) from an HF config.json dict,
        ignoring keys the forward does not use (mlx-lm style); the family's ``adjust_config``
        applies its own rules.

        Raises:
            UnsupportedModelError: an architecture outside :data:`registry.SUPPORTED_MODEL_TYPES`.
        """
        fam = registry.family(str(config.get("model_type")))
        cls = fam.Args
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in names and k != "extra"}
        # HF moved rope parameters into `rope_parameters` (transformers 5); read either.
        rope = config.get("rope_parameters") or {}
        if "rope_theta" not in kwargs and "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        if kwargs.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
            kwargs["rope_scaling"] = dict(rope)
        for key in ("head_dim", "num_key_value_heads"):
            if kwargs.get(key) is None:
                kwargs.pop(key, None)
        if "num_key_value_heads" not in kwargs and "num_attention_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # HF: no GQA
        fam.adjust_config(dict(config), kwargs)
        return cls(**kwargs)

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    def num_parameters(self) -> int:
        """Parameter count of the weights this forward holds (tied embeddings counted once)."""
        d, hd, L = self.hidden_size, self.head_dim, self.num_hidden_layers
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * self.intermediate_size + 2 * d
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * hd
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + L * per_layer + d + head

    def layer_windows(self) -> tuple[int, ...]:
        """Per layer, the sliding window its attention sees (the last N positions), 0 = every
        position (full attention). The KV store reads it (:class:`monobatch.kv.store.KvStore`)."""
        return (0,) * self.num_hidden_layers
