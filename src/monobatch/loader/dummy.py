"""Random weights of a named real shape, for benchmarks without a download (``--dummy-weights``).

Weights are drawn on the target device (normal, std 0.02; norms 1), so an 8B shape costs no
host memory. The tokenizer is a real ``tokenizers`` word-level vocabulary of the shape's size
(tokens ``<0>`` .. ``<V-1>``), enough for the engine's detokenizer; its text means nothing.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from monobatch.errors import InvalidRequestError
from monobatch.loader import LoadedModel, resolve_device, resolve_dtype
from monobatch.loader.weights import check_memory, new_model
from monobatch.models.args import ModelArgs
from monobatch.models.shapes import SHAPES

__all__ = ["SHAPES", "dummy_model"]


def dummy_model(shape: str, device: str | None = None, dtype: str | None = None, seed: int = 0,
                quant: str | None = None) -> LoadedModel:
    """A LoadedModel with random weights of ``shape`` (a key of :data:`SHAPES`).

    Args:
        quant: a packed GGUF type name (``Q4_0``, ``Q4_K``, ...): the linear layers and embeddings
            are random packed weights of that type's layout (:mod:`monobatch.quant.random_packed`).

    Raises:
        InvalidRequestError: an unknown shape or ``quant``. InsufficientMemoryError: it would not fit.
    """
    from monobatch.tokenizer import Tokenizer

    if shape not in SHAPES:
        raise InvalidRequestError(f"--shape: unknown shape {shape!r} (known: {', '.join(SHAPES)})", "shape")
    start = time.perf_counter()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    args = ModelArgs.from_dict({"model_type": "llama", **SHAPES[shape]})
    check_memory(args, dt, dev)
    model = new_model(args, dev, dt)
    gen = torch.Generator(device=dev).manual_seed(seed)
    if quant is not None:
        from monobatch.quant.packed import packed_supported
        from monobatch.quant.random_packed import pack_randomly

        if not packed_supported(dev):
            hint = " (the packed CUDA kernels need Triton)" if dev.type == "cuda" else ""
            raise InvalidRequestError(f"--quant: no packed kernels on {dev.type} here{hint}", "quant")
        try:
            pack_randomly(model, quant, gen)
        except ValueError as e:
            raise InvalidRequestError(str(e), "quant") from e
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)
    tokenizer = Tokenizer.synthetic(args.vocab_size)
    from monobatch.quant.packed import weight_bytes

    return LoadedModel(model, tokenizer, Path(f"dummy-{shape}"), {}, weight_bytes(model), time.perf_counter() - start,
                       "packed" if quant is not None else "dequant")
