"""Hugging Face checkpoint folders: config.json + safetensors (single file or sharded index)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from monobatch.errors import ModelNotFoundError, UnsupportedModelError
from monobatch.loader.weights import WeightFiller, check_memory, new_model, progress_bar
from monobatch.models.args import ModelArgs
from monobatch.models.llama import LlamaModel

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
        ModelNotFoundError: no config.json. UnsupportedModelError: an unsupported architecture.
    """
    config = read_json(folder / "config.json")
    if not config:
        raise ModelNotFoundError(f"{folder}: no config.json (expected a Hugging Face model folder or a .gguf file)")
    if "model_type" not in config:
        raise UnsupportedModelError(f"{folder}/config.json has no model_type")
    args = ModelArgs.from_dict(config)
    if not args.tie_word_embeddings and "lm_head.weight" not in _tensor_files(folder):
        args.tie_word_embeddings = True  # some exports drop the duplicate head
    return args


def generation_defaults(folder: Path) -> dict[str, Any]:
    """Sampling defaults from ``generation_config.json`` as SamplingParams fields."""
    cfg = read_json(folder / "generation_config.json")
    return {ours: cfg[key] for key, ours in _GENERATION_KEYS.items() if cfg.get(key) is not None}


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from ``model.safetensors.index.json`` or the files themselves.

    Raises:
        ModelNotFoundError: no safetensors file in the folder.
    """
    index = read_json(folder / "model.safetensors.index.json")
    if index.get("weight_map"):
        return {name: folder / file for name, file in index["weight_map"].items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder}: no *.safetensors weights (only safetensors folders are supported)")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            out.update({k: f for k in st.keys()})
    return out


def load_hf_model(folder: Path, device: torch.device, dtype: torch.dtype, progress: bool = True) -> LlamaModel:
    """Build and fill a LlamaModel from a Hugging Face folder, one tensor at a time.

    Raises:
        ModelNotFoundError, UnsupportedModelError, InsufficientMemoryError.
    """
    args = model_args(folder)
    check_memory(args, dtype, device)
    model = new_model(args, device, dtype)
    filler = WeightFiller(model)
    files = _tensor_files(folder)
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    bar = progress_bar(sum(f.stat().st_size for f in by_file), "loading weights", progress)
    with bar:
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt") as st:
                for name in names:
                    if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and args.tie_word_embeddings):
                        continue
                    t = st.get_tensor(name)
                    filler.fill(name, t)
                    bar.update(t.numel() * t.element_size())
    return filler.finish()
