"""The one registry of model families: HF ``model_type`` / GGUF ``general.architecture`` -> the
family module that runs it (mlx-lm's layout: one short file per family).

A family module defines:

* ``Args``: its :class:`~monobatch.models.args.ModelArgs` class (the base, or a subclass with
  the family's extra fields);
* ``Model``: the ``nn.Module`` (``Model(args, freq_factors=None)``; ``forward(batch, kv) ->
  logits[R, V]``), a :class:`~monobatch.models.layers.DecoderModel`;
* ``adjust_config(config, kwargs)``: the family's rules for reading an HF config.json;
* ``GGUF_ARCHITECTURES``: the GGUF architectures it runs -> their ``model_type``;
* optionally ``gguf_args(field, arch) -> dict`` (extra ``Args`` fields from GGUF metadata),
  ``GGUF_LAYER_NAMES`` (llama.cpp tensor names that differ from the Llama family's) and
  ``hf_tensor(name, tensor)`` (an HF checkpoint's tensor as the model holds it).

Modules are imported on first use, so importing this one imports no model code.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from monobatch.errors import UnsupportedModelError

#: HF ``model_type`` -> family module.
FAMILIES = {
    "llama": "monobatch.models.llama",
    "mistral": "monobatch.models.llama",
    "qwen2": "monobatch.models.llama",
    "qwen3": "monobatch.models.llama",
    "gemma3_text": "monobatch.models.gemma3",
}
#: Other ``model_type`` spellings of the same checkpoints (a multimodal Gemma 3's text config).
ALIASES = {"gemma3": "gemma3_text"}
#: GGUF ``general.architecture`` -> HF ``model_type``.
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                      "gemma3": "gemma3_text"}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def canonical(model_type: str) -> str:
    """``model_type`` as :data:`FAMILIES` names it.

    Raises:
        UnsupportedModelError: a type no family runs.
    """
    model_type = ALIASES.get(model_type, model_type)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported architecture {model_type!r}; monobatch runs {', '.join(SUPPORTED_MODEL_TYPES)}")
    return model_type


def family(model_type: str) -> ModuleType:
    """The family module of ``model_type`` (imported on first use).

    Raises:
        UnsupportedModelError: a type no family runs.
    """
    return importlib.import_module(FAMILIES[canonical(model_type)])


def model_type_of_gguf(arch: str | None) -> str:
    """HF ``model_type`` of a GGUF ``general.architecture``.

    Raises:
        UnsupportedModelError: an architecture no family runs.
    """
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {arch!r} in GGUF; monobatch runs {', '.join(GGUF_ARCHITECTURES)}")
    return GGUF_ARCHITECTURES[arch]
