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


def dummy_model(shape: str, device: str | None = None, dtype: str | None = None, seed: int = 0) -> LoadedModel:
    """A LoadedModel with random weights of ``shape`` (a key of :data:`SHAPES`).

    Raises:
        InvalidRequestError: an unknown shape. InsufficientMemoryError: it would not fit.
    """
    from monobatch.tokenizer import Tokenizer

    if shape not in SHAPES:
        raise InvalidRequestError(f"--shape: unknown shape {shape!r} (known: {', '.join(SHAPES)})", "shape")
    start = time.perf_counter()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    args = ModelArgs(model_type="llama", **SHAPES[shape])
    check_memory(args, dt, dev)
    model = new_model(args, dev, dt)
    gen = torch.Generator(device=dev).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)
    tokenizer = Tokenizer.synthetic(args.vocab_size)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return LoadedModel(model, tokenizer, Path(f"dummy-{shape}"), {}, weight_bytes, time.perf_counter() - start)
