"""Hugging Face checkpoint folders: config.json + safetensors (single file or sharded index)."""

from __future__ import annotations

import dataclasses
import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open

from monobatch.errors import ModelNotFoundError, UnsupportedModelError
from monobatch.loader.weights import WeightFiller, check_memory, new_model, progress_bar
from monobatch.models.args import ModelArgs
from monobatch.models import registry
from monobatch.models.layers import DecoderModel

#: HF generation_config.json key -> SamplingParams field (vLLM reads the same keys).
_GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repeat_penalty", "typical_p": "typical_p"}


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file as a dict; {} when absent.

    Raises:
        UnsupportedModelError: the file exists but is not valid JSON.
    """
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnsupportedModelError(f"{path}: invalid JSON ({e})") from e


def model_args(folder: Path) -> ModelArgs:
    """ModelArgs from ``config.json``.

    Raises:
        ModelNotFoundError: no config.json. UnsupportedModelError: an unsupported architecture, a
            config without model_type, a field of the wrong type.
    """
    path = folder / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"{folder}: no config.json (expected a Hugging Face model folder or a .gguf file)")
    config = read_json(path)
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"{path}: expected a JSON object, got {type(config).__name__}")
    if "model_type" not in config:
        raise UnsupportedModelError(f"{path} is incomplete: it has no model_type"
                                    + (" (the file is an empty object)" if not config else ""))
    check_config_types(config, path)
    try:
        args = ModelArgs.from_dict(config)
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:  # a value of a shape no check foresaw
        raise UnsupportedModelError(f"{path}: malformed config ({type(e).__name__}: {e})") from None
    if not args.tie_word_embeddings and "lm_head.weight" not in _tensor_files(folder):
        args.tie_word_embeddings = True  # some exports drop the duplicate head
    return args


#: ModelArgs fields that may be null in config.json (``from_dict`` fills them in).
_NULLABLE = {"head_dim", "num_key_value_heads", "rope_scaling"}
#: Integer fields that may be 0 (``head_dim`` 0 = hidden_size // num_attention_heads).
_MAY_BE_ZERO = {"head_dim"}


def check_config_types(config: dict[str, Any], path: Path) -> None:
    """Refuse a config.json value of the wrong type or range for a field the forward reads,
    naming the field (``"hidden_size": "x"`` would otherwise fail deep inside the model).

    Raises:
        UnsupportedModelError: ``PATH: FIELD must be ..., got VALUE``.
    """
    model_type = config.get("model_type")
    fields = dataclasses.fields(ModelArgs)
    if isinstance(model_type, str) and registry.ALIASES.get(model_type, model_type) in registry.FAMILIES:
        fields = dataclasses.fields(registry.family(model_type).Args)  # the family's own fields too
    for f in fields:
        if f.name == "extra" or f.name not in config:
            continue
        value = config[f.name]
        if value is None and f.name in _NULLABLE:
            continue
        if f.default is not None:
            kind = type(f.default)
        else:  # rope_scaling: a dict or null; layer_types (Gemma 3): a list or null
            kind = list if "tuple" in str(f.type) else dict
        if kind is bool:
            ok, want = isinstance(value, bool), "true or false"
        elif kind is int:
            low = 0 if f.name in _MAY_BE_ZERO else 1
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
            want = f"an integer >= {low}"
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
            want = "a number > 0"
        elif kind is str:
            ok, want = isinstance(value, str), "a string"
        elif kind is list:
            ok, want = isinstance(value, list), "a list or null"
        else:
            ok, want = isinstance(value, dict), "an object or null"
        if not ok:
            raise UnsupportedModelError(f"{path}: {f.name} must be {want}, got {json.dumps(value)[:60]}")
    for name, ok_type, want in (("rope_parameters", dict, "an object or null"),
                                ("sliding_window", int, "an integer or null"),
                                ("use_sliding_window", bool, "true or false")):
        value = config.get(name)
        if value is not None and (not isinstance(value, ok_type) or (ok_type is int and isinstance(value, bool))):
            raise UnsupportedModelError(f"{path}: {name} must be {want}, got {json.dumps(value)[:60]}")


def generation_defaults(folder: Path) -> dict[str, Any]:
    """Sampling defaults from ``generation_config.json`` as SamplingParams fields."""
    cfg = read_json(folder / "generation_config.json")
    if not isinstance(cfg, dict):
        raise UnsupportedModelError(f"{folder}/generation_config.json: expected a JSON object")
    return {ours: cfg[key] for key, ours in _GENERATION_KEYS.items() if cfg.get(key) is not None}


@contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """safetensors' ``safe_open`` of ``path``, a file it cannot read (a corrupt or truncated
    header or data, a shard the index names that is not there) reported as the project's
    model-load error, as :func:`monobatch.loader.gguf_file.open_gguf` reports a bad GGUF.

    Raises:
        UnsupportedModelError: ``{path}: not a readable safetensors file (...)``, while opening it
            or reading a tensor from it.
    """
    try:
        with safe_open(str(path), framework="pt") as st:
            yield st
    except (SafetensorError, OSError) as e:
        why = (e.strerror if isinstance(e, OSError) else None) or str(e)
        raise UnsupportedModelError(f"{path}: not a readable safetensors file ({why})") from e


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from ``model.safetensors.index.json`` or the files themselves.

    Raises:
        ModelNotFoundError: no safetensors file in the folder, or one the index names is not there.
        UnsupportedModelError: a malformed index, or a file safetensors cannot read.
    """
    index = read_json(folder / "model.safetensors.index.json")
    if not isinstance(index, dict) or not isinstance(index.get("weight_map") or {}, dict):
        raise UnsupportedModelError(f"{folder}/model.safetensors.index.json: expected an object with a "
                                    "weight_map object")
    if index.get("weight_map"):
        files = {name: folder / file for name, file in index["weight_map"].items()}
        absent = next((f for f in dict.fromkeys(files.values()) if not f.is_file()), None)
        if absent is not None:
            raise ModelNotFoundError(f"{folder}/model.safetensors.index.json names {absent.name}, which is not in "
                                     "the folder")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder}: no *.safetensors weights (only safetensors folders are supported)")
    out: dict[str, Path] = {}
    for f in files:
        with open_safetensors(f) as st:
            out.update({k: f for k in st.keys()})
    return out


def load_hf_model(folder: Path, device: torch.device, dtype: torch.dtype, progress: bool = True) -> DecoderModel:
    """Build and fill a model of the config's family from a Hugging Face folder, one tensor at a time.

    Raises:
        ModelNotFoundError, UnsupportedModelError, InsufficientMemoryError.
    """
    args = model_args(folder)
    check_memory(args, dtype, device)
    model = new_model(args, device, dtype)
    filler = WeightFiller(model)
    hf_tensor = getattr(registry.family(args.model_type), "hf_tensor", None)  # the family's conversion, if any
    files = _tensor_files(folder)
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    bar = progress_bar(sum(f.stat().st_size for f in by_file), "loading weights", progress)
    with bar:
        for file, names in by_file.items():
            with open_safetensors(file) as st:
                for name in names:
                    if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and args.tie_word_embeddings):
                        continue
                    t = st.get_tensor(name)
                    filler.fill(name, t if hf_tensor is None else hf_tensor(name, t))
                    bar.update(t.numel() * t.element_size())
    return filler.finish()
