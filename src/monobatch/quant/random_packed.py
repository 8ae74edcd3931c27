"""Random packed weights of a GGUF type, for benchmarks without a file (``bench --dummy-weights --quant``).

A packed type's kernels read only its resident layout (:mod:`monobatch.quant.formats`), so
random packed parts of the layout the type repacks into run the same kernels over the same bytes
as a real file of that type: ``qs`` uniform over the type's integer range, ``scale`` positive
(an fp16 value, or an fp16 ``d`` times an integer ``sc``, as a file's) so that the weights'
standard deviation is about 0.02 (as :mod:`monobatch.loader.dummy`'s dense weights), ``min``
centring them (Q4_0's ``-8 d``; the unsigned K-quants' ``-dmin m`` with ``m`` near the centre).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from torch import nn

from monobatch.models.layers import Linear, hold_packed
from monobatch.quant.formats import DEVICE_LAYOUTS, FACTORED, DIRECT, PACKED_TYPES
from monobatch.quant.packed import PackedPart, PackedWeight

#: GGUF type -> (lowest q, highest q) in its resident layout (formats.py's table).
Q_RANGE = {T.Q4_0: (0, 15), T.Q4_1: (0, 15), T.Q4_K: (0, 15), T.Q8_0: (-128, 127), T.Q5_0: (-16, 15),
           T.Q5_K: (0, 31), T.Q6_K: (-32, 31)}


def random_weight(qtype: T, n: int, k: int, device: torch.device, gen: torch.Generator,
                  std: float = 0.02) -> PackedWeight:
    """A random ``[n, k]`` PackedWeight of ``qtype`` on ``device`` (k a multiple of the type's block):
    on CUDA in the compact layout the loader makes there (:data:`~monobatch.quant.formats.DEVICE_LAYOUTS`:
    float16 scales, or the K-quants' integer factors under a float16 ``d`` and ``dmin`` per 256
    weights), elsewhere in the DIRECT float32 layout of :data:`~monobatch.quant.formats.PACKED_TYPES`
    with the same values."""
    layout = DEVICE_LAYOUTS[qtype]
    lo, hi = Q_RANGE[qtype]
    groups = k // layout.group
    width = k // 2 if layout.q4 else k
    if layout.q4:
        qs = torch.randint(0, 256, (n, width), generator=gen, device=device, dtype=torch.uint8)
    else:
        qs = torch.randint(lo, hi + 1, (n, width), generator=gen, device=device, dtype=torch.int8)
    step = std / ((hi - lo + 1) / 12**0.5)  # uniform q: std (hi - lo + 1) / sqrt(12)
    centre = (lo + hi) / 2 if lo >= 0 else 0.0  # the min centres unsigned q: -centre * scale
    sup = minimum = None
    if layout.scales == FACTORED:  # sc in 32..63 under d, m = centre * sc / 16 under dmin = 16 d
        d = ((torch.rand(n, k // 256, 1, generator=gen, device=device) * 0.5 + 0.75) * step / 48).half()
        dmin = (d.float() * 16).half() if layout.mins == FACTORED else torch.zeros_like(d)  # Q6_K: none (as loaded)
        sup = torch.cat([d, dmin], dim=-1)
        sc = torch.randint(32, 64, (n, groups), generator=gen, device=device, dtype=torch.uint8)
        scale = sc.to(torch.int8) if qtype == T.Q6_K else sc
        if layout.mins == FACTORED:
            minimum = (sc.float() * centre / 16).round().to(torch.uint8)
    else:
        scale = ((torch.rand(n, groups, generator=gen, device=device) * 0.5 + 0.75) * step).half()
        if layout.mins == DIRECT:
            minimum = (scale.float() * -centre).half()
    part = PackedPart(layout, qs, scale, minimum, sup)
    if device.type != "cuda":
        part = part.direct()
    return PackedWeight([part], k, (qtype.name,))


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
