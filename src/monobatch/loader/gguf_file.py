"""GGUF checkpoints (llama.cpp's format), read with the ``gguf`` package.

With ``weights="packed"`` (the default where the packed kernels run: CPU with the compiled kernels,
CUDA with Triton, :func:`monobatch.quant.packed.packed_supported`) every 2-D weight of a
packed type (:data:`monobatch.quant.formats.PACKED_TYPES`) stays packed: its blocks are repacked
once into a resident layout (:func:`monobatch.quant.formats.repack`; on CUDA the raw blocks are
copied to the GPU and repacked there, :mod:`monobatch.quant.device_repack`) and held as a
:class:`~monobatch.quant.packed.PackedWeight` (ADR 0006). Every other tensor, and every tensor
with ``weights="dequant"``, is dequantized on its own by ``gguf.quants.dequantize`` (every type
gguf-py can dequantize) and copied into the model's compute dtype, so peak memory is the final
weights plus one float32 tensor. llama.cpp's converter permutes the Q and K rows of ``llama`` checkpoints for
its interleaved RoPE; we undo it (as transformers' GGUF loader does) and run HF's rotate-half
RoPE, so GGUF and safetensors checkpoints share one forward.
"""

from __future__ import annotations

import inspect
import logging
import mmap
import re
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from monobatch.errors import UnsupportedModelError
from monobatch.loader.weights import WeightFiller, check_memory, new_model, param_target, progress_bar
from monobatch.models import registry
from monobatch.models.args import ModelArgs
from monobatch.models.layers import DecoderModel
from monobatch.quant import device_repack
from monobatch.quant.formats import PACKED_TYPES, Repacked, narrow_scales, repack, resident_bytes
from monobatch.quant.packed import packed_supported

log = logging.getLogger(__name__)
#: ``--weights`` values: held packed where a kernel runs them, or dequantized at load.
WEIGHT_MODES = ("packed", "dequant")
#: Types that are not quantized: dequantizing them is only a cast (norms, F16 files).
_FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}

#: GGUF tensor name -> HF name (``{i}`` is the layer index). llama.cpp's tensor naming; a family
#: whose names differ lists them in its ``GGUF_LAYER_NAMES`` (:mod:`monobatch.models.registry`).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """One metadata value (scalars, strings and arrays decoded by gguf-py), or ``default``."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_name(gguf_name: str, model_type: str = "llama") -> str | None:
    """llama.cpp tensor name -> HF name for ``model_type``'s family; None for tensors the forward
    does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    names = {**_LAYER_NAMES, **getattr(registry.family(model_type), "GGUF_LAYER_NAMES", {})}
    if m and m.group(2) in names:
        return f"layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def model_args(reader: GGUFReader) -> ModelArgs:
    """ModelArgs from GGUF metadata (``{arch}.block_count`` etc., llama.cpp's key names).

    Raises:
        UnsupportedModelError: an architecture no family runs (:mod:`monobatch.models.registry`),
            or partial RoPE.
    """
    arch = field(reader, "general.architecture")
    model_type = registry.model_type_of_gguf(arch)
    fam = registry.family(model_type)
    names = {t.name for t in reader.tensors}
    heads = int(field(reader, f"{arch}.attention.head_count"))
    hidden = int(field(reader, f"{arch}.embedding_length"))
    head_dim = int(field(reader, f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
    scaling = None
    kind = field(reader, f"{arch}.rope.scaling.type")
    if kind and kind != "none":
        scaling = {"rope_type": kind, "factor": float(field(reader, f"{arch}.rope.scaling.factor", 1.0)),
                   "original_max_position_embeddings": field(reader, f"{arch}.rope.scaling.original_context_length")}
    tokens = field(reader, "tokenizer.ggml.tokens")
    extra = fam.gguf_args(lambda key, default=None: field(reader, key, default), arch) if hasattr(fam, "gguf_args") else {}
    return fam.Args(
        model_type=model_type,
        hidden_size=hidden,
        num_hidden_layers=int(field(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(field(reader, f"{arch}.feed_forward_length")),
        vocab_size=int(field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0)),
        max_position_embeddings=int(field(reader, f"{arch}.context_length", 4096)),
        rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        **extra,
    )


def generation_defaults(reader: GGUFReader) -> dict[str, Any]:
    """Sampling defaults a GGUF recommends (``general.sampling.*``, llama.cpp), as SamplingParams fields."""
    keys = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
            "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
            "general.sampling.penalty_repeat": "repeat_penalty", "general.sampling.penalty_last_n": "repeat_last_n"}
    return {ours: field(reader, key) for key, ours in keys.items() if field(reader, key) is not None}


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp convert_hf_to_gguf.py's ``permute`` of Q/K rows (interleaved -> rotate-half)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def dequantize_tensor(t: Any, rows_per_chunk: int = 4096) -> np.ndarray:
    """One GGUF tensor as float32 in numpy (row-major, HF's ``[out, in]`` order).

    Dequantized ``rows_per_chunk`` rows at a time into the output, so the transient memory of a
    large matrix (the embeddings) is one chunk rather than gguf-py's full-size intermediates.

    Raises:
        UnsupportedModelError: a type gguf-py cannot dequantize.
    """
    qtype = GGMLQuantizationType(int(t.tensor_type))
    shape = tuple(int(n) for n in reversed(t.shape))
    out = np.empty(shape, dtype=np.float32)
    flat_out = out.reshape(-1, shape[-1])
    data = t.data.reshape(flat_out.shape[0], -1)
    try:
        for i in range(0, data.shape[0], rows_per_chunk):
            flat_out[i:i + rows_per_chunk] = dequantize(data[i:i + rows_per_chunk], qtype).reshape(-1, shape[-1])
    except NotImplementedError as e:
        raise UnsupportedModelError(f"tensor {t.name}: weight type {qtype.name} cannot be dequantized ({e})") from e
    return out


def packed_targets(reader: GGUFReader, args: ModelArgs) -> set[str]:
    """The parameters to hold packed: those every one of whose GGUF tensors (a fused qkv has
    three) is a 2-D tensor of a packed type."""
    ok: dict[str, bool] = {}
    for t in reader.tensors:
        name = hf_name(t.name, args.model_type)
        if name is not None:
            target = param_target(name, args)[0]
            packable = GGMLQuantizationType(int(t.tensor_type)) in PACKED_TYPES and len(t.shape) == 2
            ok[target] = ok.get(target, True) and packable
    return {target for target, packable in ok.items() if packable}


def _drop_pages(reader: GGUFReader) -> None:
    """Give the file's mapped pages back (``MADV_DONTNEED`` on the read-only map) after a tensor
    is copied: otherwise every page read stays resident until the file is unmapped, and the peak
    RSS of loading holds the whole file beside the weights. The whole map, not only the copied
    tensor's pages: a read fault maps the pages around it too (fault-around, a whole large folio
    of the page cache), so reading a tensor maps its neighbours' pages as well, and those of the
    tensors before it, once dropped, came back and stayed (the bundled model: ~50 of its 94 MiB
    resident when loading ended, 2026-12-03, kernel 6.18). A page still to be read is read again
    from the page cache (a minor fault)."""
    m = getattr(reader.data, "_mmap", None)  # numpy.memmap's mmap object
    if m is None or not hasattr(m, "madvise"):
        return
    try:
        m.madvise(mmap.MADV_DONTNEED)
    except (OSError, ValueError):
        pass


def repack_on(device: torch.device, qtype: GGMLQuantizationType, rows: np.ndarray, k: int) -> Repacked:
    """Raw rows (uint8 ``[N, row bytes]``, possibly a read-only view of the file) -> the resident
    layout on ``device``: numpy on CPU (scales and mins float16 where exact:
    :func:`~monobatch.quant.formats.narrow_scales`); elsewhere the bytes go to the device as they
    are in the file and are repacked there (bitwise the same layout)."""
    if device.type == "cpu":
        return narrow_scales(repack(qtype, rows, k))
    with warnings.catch_warnings():  # a read-only memmap view: torch only reads it (the copy to the device)
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(np.ascontiguousarray(rows)).to(device)
    return device_repack.repack(qtype, raw, k)


def _log_weights(kinds: Counter, weights: str, pack: bool) -> None:
    """One line: which types were packed and which dequantized; quantized types left dense while
    packing (no packed layout for them) also get a warning."""
    packed = ", ".join(f"{t} x{n}" for (t, p), n in sorted(kinds.items()) if p)
    dense = ", ".join(f"{t} x{n}" for (t, p), n in sorted(kinds.items()) if not p)
    unpacked = sorted({t for t, p in kinds if not p and GGMLQuantizationType[t] not in _FLOAT_TYPES})
    if pack and unpacked:
        log.warning("weights: %s have no packed kernel; dequantized at load", ", ".join(unpacked))
    log.info("weights %s: packed %s; dequantized %s", weights, packed or "none", dense or "none")


def load_gguf_model(reader: GGUFReader, device: torch.device, dtype: torch.dtype,
                    progress: bool = True, args: ModelArgs | None = None, weights: str = "packed") -> DecoderModel:
    """Build and fill a model of the file's family from an open GGUF file (``args`` from :func:`model_args`,
    read here when not given, so the caller may drop the parsed metadata first).

    Args:
        weights: ``packed`` (packed types stay packed where :func:`packed_supported`: CPU with
            the compiled kernels, CUDA with Triton; elsewhere dequantized, said in the
            log) or ``dequant``.

    Raises:
        UnsupportedModelError, InsufficientMemoryError: see :func:`model_args`, :func:`check_memory`.
    """
    args = args or model_args(reader)
    pack = weights == "packed" and packed_supported(device)
    if weights == "packed" and not pack:
        why = "no Triton for the packed CUDA kernels" if device.type == "cuda" \
            else f"no packed kernels on {device.type} here"
        log.warning("weights: %s; dequantized at load into %s", why, str(dtype).removeprefix("torch."))
    packed = packed_targets(reader, args) if pack else set()
    elt = torch.tensor([], dtype=dtype).element_size()
    used = [(t, hf_name(t.name, args.model_type)) for t in reader.tensors]
    used = [(t, name, param_target(name, args)[0] in packed) for t, name in used if name is not None]
    compact = device.type != "cpu"  # CUDA's repack keeps the file's scales (formats.DEVICE_LAYOUTS)
    need = sum(resident_bytes(GGMLQuantizationType(int(t.tensor_type)), int(t.n_elements), compact) if p
               else int(t.n_elements) * elt for t, _, p in used)
    check_memory(args, dtype, device, need, "packed weights" if packed else None)
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    freq_factors = torch.from_numpy(dequantize_tensor(rope_freqs).copy()) if rope_freqs is not None else None
    model = new_model(args, device, dtype, freq_factors, held=packed)
    filler = WeightFiller(model)
    permute = args.model_type in ("llama", "mistral")
    kinds: Counter = Counter()
    bar = progress_bar(sum(int(t.n_bytes) for t, _, _ in used), "loading weights", progress)
    with bar:
        for t, name, held in used:
            qtype = GGMLQuantizationType(int(t.tensor_type))
            kinds[qtype.name, held] += 1
            shape = tuple(int(n) for n in reversed(t.shape))
            w = np.asarray(t.data).reshape(shape[0], -1) if held else dequantize_tensor(t)
            if permute and (".q_proj." in name or ".k_proj." in name):
                n = args.num_attention_heads if ".q_proj." in name else args.num_key_value_heads
                w = unpermute_qk(w, n)  # a row permutation: packed rows move as the float rows do
            if held:
                filler.fill_packed(name, repack_on(device, qtype, w, shape[-1]), qtype.name)
            else:
                filler.fill(name, w)
            del w
            _drop_pages(reader)
            bar.update(int(t.n_bytes))
    _log_weights(kinds, weights, pack)
    return filler.finish()


class TruncatedGGUF(ValueError):
    """A tensor's data, or the header itself, runs past the end of the file (a download or copy
    cut short).

    Attributes:
        end: the byte that tensor's data (or the header field) runs to.
        size: the file's size in bytes.
        header: True when the header (metadata or tensor infos) is what runs past the end.
    """

    def __init__(self, end: int, size: int, header: bool = False) -> None:
        what = "the header runs past the end of the file" if header else "tensor data past the end of the file"
        part = "the header" if header else "a tensor's data"
        super().__init__(f"{what}: the file has {size} byte{'' if size == 1 else 's'}, {part} runs to byte {end}")
        self.end, self.size, self.header = end, size, header


class MappedReader(GGUFReader):
    """gguf-py's reader, its header parsed through a plain ``ndarray`` view of the file map
    rather than the ``numpy.memmap`` itself. gguf-py takes three small slices per field part —
    ~250K for a 49K-token vocabulary and its merges — and under numpy 2 every slice of a memmap
    runs ``memmap.__array_finalize__``: the bundled model's header took 6.3 s to read, 2.2 s so
    (2026-12-01, this project's CPU machine; gguf 0.19, numpy 2.4). Same bytes and the same lazily
    paged map (the view shares the memmap's buffer; ``data`` stays the memmap, whose ``_mmap``
    :func:`_drop_pages` uses); only the type of the slices handed out differs. It replaces
    gguf-py's private ``_get``: :func:`open_gguf` takes it only where that method has the
    signature it was written against (:data:`_GET_PARAMS`), else gguf-py's own reader.

    An array of strings or scalars (the vocabulary, its merges, scores and token types) is read in
    one loop (:meth:`_get_field_parts`) rather than through gguf-py's recursion, which makes two
    ``_get`` calls (each four array views) per string: the same parts, offsets and types, the
    bundled model's header in 0.3 s rather than 1.6 s, Gemma 3's (262K tokens) in 1.2 s rather
    than 8 s (2026-12-02, this project's CPU machine). tests/test_loader.py holds every field,
    part and tensor equal to gguf-py's reader's."""

    def _plain_view(self) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        return plain

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        """gguf-py's, the slice's bytes taken from the plain view; a tensor's data (at or past
        ``data_offset``, which gguf-py sets before it builds the tensors) that runs past the end
        of the file raises :class:`TruncatedGGUF` rather than numpy's reshape error, and so does a
        header field (before ``data_offset``) that does (a file cut inside its metadata)."""
        plain = self._plain_view()
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        if end > plain.size:  # before gguf-py sets data_offset, every read is the header's
            data_offset = self.__dict__.get("data_offset")
            raise TruncatedGGUF(end, plain.size, header=data_offset is None or offset < data_offset)
        arr = plain[offset:end].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list[Any]]:
        """gguf-py's ``_get_field_parts``, an array of strings or scalars in one loop: per string
        its length (``uint64``, shape ``(1,)``) and its bytes (``uint8``), per scalar one element,
        each a view of the map as gguf-py makes them; any other field goes to gguf-py's."""
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        itype = GGUFValueType(int(raw_itype[0]))
        nptype = self.gguf_scalar_to_np.get(itype)
        if itype != GGUFValueType.STRING and nptype is None:  # an array of arrays: gguf-py's recursion
            return super()._get_field_parts(orig_offs, raw_type)
        plain = self._plain_view()
        offs = orig_offs + int(raw_itype.nbytes)
        alen = self._get(offs, np.uint64)
        offs += int(alen.nbytes)
        parts, idxs, n = [raw_itype, alen], [], int(alen[0])
        if itype == GGUFValueType.STRING:
            len_dt, byte_dt = (np.dtype(t).newbyteorder(self.byte_order) for t in (np.uint64, np.uint8))
            for _ in range(n):
                if offs + 8 > plain.size:
                    raise TruncatedGGUF(offs + 8, plain.size, header=True)
                slen = plain[offs:offs + 8].view(len_dt)
                k = int(slen[0])
                if offs + 8 + k > plain.size:
                    raise TruncatedGGUF(offs + 8 + k, plain.size, header=True)
                parts += (slen, plain[offs + 8:offs + 8 + k].view(byte_dt))
                idxs.append(len(parts) - 1)
                offs += 8 + k
        else:
            dt = np.dtype(nptype).newbyteorder(self.byte_order)
            if offs + n * dt.itemsize > plain.size:
                raise TruncatedGGUF(offs + n * dt.itemsize, plain.size, header=True)
            for _ in range(n):
                parts.append(plain[offs:offs + dt.itemsize].view(dt))
                idxs.append(len(parts) - 1)
                offs += dt.itemsize
        types = [GGUFValueType.ARRAY] + ([itype] if n else [])  # gguf-py takes the item type from item 0
        return offs - orig_offs, parts, idxs, types


#: The parameters of ``GGUFReader._get`` and ``_get_field_parts`` that :class:`MappedReader`
#: replaces (as in gguf-py 0.19).
_GET_PARAMS = ("self", "offset", "dtype", "count", "override_order")
_FIELD_PARTS_PARAMS = ("self", "orig_offs", "raw_type")
_READER = MappedReader if (tuple(inspect.signature(GGUFReader._get).parameters) == _GET_PARAMS
                           and tuple(inspect.signature(GGUFReader._get_field_parts).parameters)
                           == _FIELD_PARTS_PARAMS) else GGUFReader


def check_magic(path: str | Path) -> None:
    """Refuse a file that does not start with GGUF's magic (its first 4 bytes, ``GGUF``), without
    parsing it: ``serve``'s check before it listens (the load, on its own thread, parses it).

    Raises:
        UnsupportedModelError: another file (the message :func:`open_gguf` gives it).
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"GGUF":
        raise UnsupportedModelError(f"{path}: not a readable GGUF file (GGUF magic invalid)")


def open_gguf(path: str | Path) -> GGUFReader:
    """Open a GGUF file (memory-mapped, read-only) with gguf-py (:class:`MappedReader`).

    Raises:
        UnsupportedModelError: the file is not a readable GGUF, or is truncated.
    """
    try:
        return _READER(str(path), "r")
    except TruncatedGGUF as e:
        if e.size < 4 and not b"GGUF".startswith(Path(path).read_bytes()):  # too short for the magic, and not its start
            raise UnsupportedModelError(f"{path}: not a readable GGUF file (GGUF magic invalid)") from e
        raise UnsupportedModelError(f"{path}: the file is truncated ({e})") from e
    except Exception as e:  # gguf-py raises ValueError/struct errors on bad files
        raise UnsupportedModelError(f"{path}: not a readable GGUF file ({e})") from e
