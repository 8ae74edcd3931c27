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

#: Named shapes (HF config fields). smollm2-135m is the bundled model's; llama-1b is Llama 3.2
#: 1B's layout with SmolLM2's vocabulary; llama-8b is Llama 3.1 8B's; tiny is a 2-layer model for
#: smoke and property tests (milliseconds a step on CPU).
SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, max_position_embeddings=256, rope_theta=10000.0,
                 tie_word_embeddings=True),
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192, vocab_size=49152, max_position_embeddings=16384,
                     rope_theta=500000.0, tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                     rope_theta=500000.0, tie_word_embeddings=False),
}


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
