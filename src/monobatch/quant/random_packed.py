"""Random packed weights of a GGUF type, for benchmarks without a file (``bench --dummy-weights --quant``).

A packed type's kernels read only its resident layout (:mod:`monobatch.quant.formats`), so
random packed parts of the layout the type repacks into run the same kernels over the same bytes
as a real file of that type: ``qs`` uniform over the type's integer range, ``scale`` positive
(an fp16 value, as a file's) so that the weights' standard deviation is about 0.02 (as
:mod:`monobatch.loader.dummy`'s dense weights), ``min`` centring them (Q4_0's ``-8 d``; the
unsigned K-quants' ``-dmin m`` drawn near the centre). Q4_0 and Q4_K share a layout, hence their
speed here; what differs between them in a real file is only the values.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from torch import nn

from monobatch.models.layers import Linear, hold_packed
from monobatch.quant.formats import PACKED_TYPES
from monobatch.quant.packed import PackedPart, PackedWeight

#: GGUF type -> (lowest q, highest q) in its resident layout (formats.py's table).
Q_RANGE = {T.Q4_0: (0, 15), T.Q4_1: (0, 15), T.Q4_K: (0, 15), T.Q8_0: (-128, 127), T.Q5_0: (-16, 15),
           T.Q5_K: (0, 31), T.Q6_K: (-32, 31)}


def random_weight(qtype: T, n: int, k: int, device: torch.device, gen: torch.Generator,
                  std: float = 0.02) -> PackedWeight:
    """A random ``[n, k]`` PackedWeight of ``qtype``'s layout on ``device`` (k a multiple of the type's block)."""
    layout = PACKED_TYPES[qtype]
    lo, hi = Q_RANGE[qtype]
    groups = k // layout.group
    width = k // 2 if layout.q4 else k
    if layout.q4:
        qs = torch.randint(0, 256, (n, width), generator=gen, device=device, dtype=torch.uint8)
    else:
        qs = torch.randint(lo, hi + 1, (n, width), generator=gen, device=device, dtype=torch.int8)
    step = std / ((hi - lo + 1) / 12**0.5)  # uniform q: std (hi - lo + 1) / sqrt(12)
    scale = (torch.rand(n, groups, generator=gen, device=device) * 0.5 + 0.75) * step
    scale = scale.half().float()
    centre = -(lo + hi) / 2 if lo >= 0 else 0.0
    minimum = scale * centre if qtype != T.Q4_0 else -8 * scale
    return PackedWeight([PackedPart(layout, qs, scale, minimum.contiguous())], k, (qtype.name,))


def pack_randomly(model: nn.Module, qtype_name: str, gen: torch.Generator) -> None:
    """Replace every Linear's weight and the embeddings of ``model`` (a DecoderModel) by random
    packed weights of GGUF type ``qtype_name`` on the model's device (the dense parameters are
    freed one by one).

    Raises:
        ValueError: a type without a packed layout, or an input width that is not a multiple of
            the type's block (32; 256 for the K-quants).
    """
    try:
        qtype = T[qtype_name]
    except KeyError:
        qtype = None
    if qtype not in PACKED_TYPES:
        raise ValueError(f"--quant: {qtype_name!r} is not a packed type ({', '.join(t.name for t in PACKED_TYPES)})")
    device = model.device
    targets = [(m, "weight") for m in model.modules() if isinstance(m, Linear)] + [(model, "embed_tokens")]
    for module, name in targets:
        n, k = getattr(module, name).shape
        block = GGML_QUANT_SIZES[qtype][0]
        if k % block:
            raise ValueError(f"--quant {qtype.name}: input widths must be multiples of {block} (a {n}x{k} weight)")
        hold_packed(module, name, random_weight(qtype, n, k, device, gen))
