"""Tokenizer: GGUF and HF-folder vocabularies against transformers, llama.cpp conventions, errors.

The bundled SmolLM2 GGUF says ``tokenizer.ggml.pre = smollm``: llama.cpp splits every digit
(``\\p{N}``) before GPT-2's regex, as SmolLM2's own tokenizer.json does. transformers' GGUF loader
does not know ``smollm`` and uses plain GPT-2 splitting, so we check three things: equality with
HF's GGUF tokenizer on text without numeric characters, equality everywhere with HF's tokenizer
given SmolLM2's real pre-tokenizer, and the exact difference on numerals.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import shutil

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from monobatch.errors import InvalidRequestError, ModelNotFoundError, UnsupportedModelError
from monobatch.tokenizer import Tokenizer
from monobatch.tokenizer.gguf_vocab import PRE_FAMILY as _PRE_FAMILY

# fixtures and helpers (tests/ is on sys.path via conftest.py)
from fixtures_tokenizer import (hf_smollm, smollm_reader, smollm_tokenizer,  # noqa: F401
                                write_bpe_gguf, write_spm_gguf)


CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # code\n",
    "12345", "Pi is 3.14159, e is 2.71828 and 2024-05-01T12:00:00Z.", "a1b22c333 0x1F",
    "你好，世界！日本語のテキスト。한국어 텍스트",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 keycap 1️⃣",
    "Café déjà vu — naïve façade, e\u0301 (combining), Ångström, Straße",
    "   leading, trailing   \t\ttabs\n\n\nnewlines \r\n  ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "don't I'll we've THEY'RE it's",
    "",
]
NUMERALS = "x² ½ ٣ Ⅻ ０"  # \p{N} beyond ASCII digits: where HF's GGUF loader and llama.cpp differ
UNICODE_FRAGMENTS = ["👨‍👩‍👧‍👦", "🏳️‍🌈", "👍🏽", "🇯🇵", "日本語", "한국어", "e\u0301", "ñ", "Å", "ß", "\u200d", " ", "\n",
                     "  ", "12", "٣", "½", "<|im_end|>", "<|im_start|>", "'s"]
unicode_text = st.lists(st.one_of(st.sampled_from(UNICODE_FRAGMENTS), st.text(st.characters(codec="utf-8"), max_size=6)),
                        max_size=12).map("".join)


def has_numeric(text: str) -> bool:
    return any(ch.isnumeric() for ch in text)


@pytest.fixture(scope="module")
def smollm_reference(hf_smollm):
    """HF's GGUF tokenizer with SmolLM2's real tokenizer.json pre-tokenizer (digits, then GPT-2)."""
    backend = copy.deepcopy(hf_smollm.backend_tokenizer)
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return backend


@pytest.fixture(scope="module")
def missing_bytes(smollm_tokenizer):
    """Bytes the SmolLM2 vocabulary cannot spell (e.g. 0xF1: code points U+40000..U+7FFFF)."""
    single = {smollm_tokenizer.token_bytes(i) for i in range(smollm_tokenizer.vocab_size)}
    return {b for b in range(256) if bytes([b]) not in single}


# -- the bundled GGUF ----------------------------------------------------------------------------
def test_gguf_metadata(smollm_tokenizer, smollm_reader):
    tok = smollm_tokenizer
    assert tok.vocab_size == 49152
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, False)  # add_bos_token False in the file
    assert tok.eog_ids == {0, 2}  # EOS <|im_end|> and <|endoftext|> (llama.cpp's EOG names)
    assert tok.chat_template == smollm_reader.fields["tokenizer.chat_template"].contents()
    assert all(tok.is_special(i) for i in range(17)) and not tok.is_special(17)


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_hf(smollm_tokenizer, hf_smollm, smollm_reference, text):
    ids = smollm_tokenizer.encode(text)
    assert ids == smollm_reference.encode(text, add_special_tokens=False).ids
    assert ids == hf_smollm.encode(text)  # ASCII digits agree: the vocab has no multi-digit tokens
    assert ids == hf_smollm.encode(text, add_special_tokens=True)  # HF adds no BOS either


def test_numerals_split_like_llama_cpp(smollm_tokenizer, hf_smollm, smollm_reference):
    """smollm pre-tokenizer: every \\p{N} character is its own piece; HF's GGUF loader differs."""
    tok = smollm_tokenizer
    assert [tok.decode([i]) for i in tok.encode("12345")] == list("12345")
    assert [tok.decode([i]) for i in tok.encode("in 2024")] == ["in", " ", "2", "0", "2", "4"]
    ids = tok.encode(NUMERALS)
    assert ids == smollm_reference.encode(NUMERALS, add_special_tokens=False).ids
    assert ids != hf_smollm.encode(NUMERALS)
    assert tok.decode(ids) == NUMERALS


@settings(max_examples=300, deadline=None)
@given(text=unicode_text)
def test_encode_matches_hf_property(smollm_tokenizer, hf_smollm, smollm_reference, text):
    ids = smollm_tokenizer.encode(text)
    assert ids == smollm_reference.encode(text, add_special_tokens=False).ids
    if not has_numeric(text):
        assert ids == hf_smollm.encode(text)


@settings(max_examples=300, deadline=None)
@given(text=unicode_text)
def test_round_trip_and_token_bytes(smollm_tokenizer, missing_bytes, text):
    ids = smollm_tokenizer.encode(text)
    raw = b"".join(smollm_tokenizer.token_bytes(i) for i in ids)
    if not missing_bytes & set(text.encode("utf-8")):
        assert raw == text.encode("utf-8")
        assert smollm_tokenizer.decode(ids, skip_special_tokens=False) == text
    assert raw.decode("utf-8", "replace") == smollm_tokenizer.decode(ids, skip_special_tokens=False)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=24), skip=st.booleans())
def test_decode_matches_hf(smollm_tokenizer, hf_smollm, ids, skip):
    assert smollm_tokenizer.decode(ids, skip_special_tokens=skip) == hf_smollm.decode(ids, skip_special_tokens=skip)


def test_special_tokens(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == 1
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.token_bytes(2) == b"<|im_end|>"
    assert tok.token_bytes(tok.encode(" the")[0]) == b" the"  # "Ġthe"


def test_out_of_range_ids(smollm_tokenizer):
    with pytest.raises(InvalidRequestError):
        smollm_tokenizer.decode([1, 49152])
    with pytest.raises(InvalidRequestError):
        smollm_tokenizer.decode([-1])
    with pytest.raises(InvalidRequestError):
        smollm_tokenizer.token_bytes(49152)


# -- BOS: llama.cpp defaults and the F2 rule -------------------------------------------------------
@pytest.mark.parametrize("pre, flag, expected", [("gpt-2", None, False), ("llama-bpe", None, True),
                                                 ("llama-bpe", False, False), ("smollm", True, True)])
def test_add_bos_default(tmp_path, pre, flag, expected):
    tok = Tokenizer.from_gguf(gguf.GGUFReader(write_bpe_gguf(tmp_path / "v.gguf", pre, add_bos=flag)))
    assert tok.add_bos is expected
    assert tok.encode("the") == ([0] if expected else []) + tok.encode("the", add_special_tokens=False)


def test_encode_never_doubles_bos(tmp_path):
    """Field case F2: text that starts with the BOS text gets no second BOS from encode."""
    tok = Tokenizer.from_gguf(gguf.GGUFReader(write_bpe_gguf(tmp_path / "v.gguf", "llama-bpe")))
    assert tok.encode("<|endoftext|> the") == [0] + tok.encode(" the", add_special_tokens=False)
    assert tok.encode("") == [0] and tok.encode("", add_special_tokens=False) == []


# -- every pre-tokenizer family compiles and round-trips ---------------------------------------------
@pytest.mark.parametrize("pre", sorted({family: name for name, family in _PRE_FAMILY.items()}.values()))
def test_pre_tokenizer_families(tmp_path, pre):
    tok = Tokenizer.from_gguf(gguf.GGUFReader(write_bpe_gguf(tmp_path / "v.gguf", pre)))
    text = "Hello the world! 12345 don't\n\n  x² 日本語 😀<|endoftext|>"
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text
    assert tok.encode(" the", add_special_tokens=False)[-1] == tok.vocab_size - 1  # merges applied


def test_unknown_pre_falls_back_to_gpt2(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        tok = Tokenizer.from_gguf(gguf.GGUFReader(write_bpe_gguf(tmp_path / "v.gguf", "no-such-pre")))
    assert "no-such-pre" in caplog.text
    reference = Tokenizer.from_gguf(gguf.GGUFReader(write_bpe_gguf(tmp_path / "g.gguf", "gpt-2")))
    assert tok.encode("a 123 the x") == reference.encode("a 123 the x")


# -- SentencePiece ("llama") vocabularies --------------------------------------------------------------
@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory):
    """(monobatch, transformers) tokenizers of a synthetic SentencePiece-BPE GGUF."""
    from transformers import AutoTokenizer

    path = write_spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf")
    return Tokenizer.from_gguf(gguf.GGUFReader(path)), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@settings(max_examples=300, deadline=None)
@given(text=unicode_text)
def test_spm_matches_hf(spm_pair, text):
    """Equal to transformers' GGUF converter wherever llama.cpp and it agree on the space prefix."""
    ours, hf = spm_pair
    ids = ours.encode(text)
    if not text.startswith((" ", "▁")) and not re.search(r"</?s>|<unk>", text):
        assert ids == hf.encode(text)
        if "▁" not in text:
            assert ours.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 461), max_size=20), skip=st.booleans())
def test_spm_decode_matches_hf(spm_pair, ids, skip):
    ours, hf = spm_pair
    assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_spm_space_prefix_follows_llama_cpp(spm_pair):
    """One ``▁`` before every stretch of text, even one starting with a space or after a special
    token (llama.cpp, SentencePiece); HF's Metaspace(prepend_scheme="first") skips those."""
    ours, hf = spm_pair
    assert (ours.bos_id, ours.eos_id, ours.add_bos, ours.eog_ids) == (1, 2, True, {2})
    assert b"".join(ours.token_bytes(i) for i in ours.encode(" hi", add_special_tokens=False)) == b"  hi"
    assert "".join(hf.convert_ids_to_tokens(hf.encode(" hi", add_special_tokens=False))) == "▁hi"
    assert ours.encode("a</s>b") == ours.encode("a") + [2] + ours.encode("b", add_special_tokens=False)
    assert ours.token_bytes(ours.encode("b", add_special_tokens=False)[0]).startswith(b" ")
    assert ours.decode(ours.encode(" leading")) == " leading"  # the Strip decoder drops only the prefix
    assert ours.token_bytes(3 + 0x41) == b"A"  # <0x41>
    assert ours.token_bytes(ours.encode("the", add_special_tokens=False)[0]) == b" the"  # "▁the"


def test_spm_without_space_prefix(tmp_path):
    tok = Tokenizer.from_gguf(gguf.GGUFReader(write_spm_gguf(tmp_path / "s.gguf", add_bos=False, add_space_prefix=False)))
    assert tok.add_bos is False
    ids = tok.encode("the theory")
    assert not tok.token_bytes(ids[0]).startswith(b" ")
    assert tok.decode(ids) == "the theory"


# -- Hugging Face folders -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, hf_smollm):
    """A SmolLM2-shaped HF folder: HF's export of the GGUF tokenizer with SmolLM2's pre-tokenizer."""
    root = tmp_path_factory.mktemp("hf")
    hf_smollm.save_pretrained(root)
    spec = json.loads((root / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    (root / "tokenizer.json").write_text(json.dumps(spec))
    (root / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 7]}))
    return root


def test_hf_dir_matches_gguf(hf_dir, smollm_tokenizer):
    tok = Tokenizer.from_hf_dir(hf_dir)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos) == (49152, 1, 2, False)
    assert tok.eog_ids == {0, 2, 7}  # generation_config's EOS list joins
    assert tok.chat_template == smollm_tokenizer.chat_template  # from chat_template.jinja
    for text in [*CORPUS, NUMERALS]:
        ids = tok.encode(text)
        assert ids == smollm_tokenizer.encode(text)
        assert [tok.token_bytes(i) for i in ids] == [smollm_tokenizer.token_bytes(i) for i in ids]
    messages = [{"role": "user", "content": "hi"}]
    assert tok.encode_chat(messages) == smollm_tokenizer.encode_chat(messages)


def test_hf_dir_add_bos(hf_dir, tmp_path):
    root = tmp_path / "m"
    shutil.copytree(hf_dir, root)
    (root / "chat_template.jinja").unlink()
    config = json.loads((root / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "y"}]
    (root / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    tok = Tokenizer.from_hf_dir(root)
    assert tok.add_bos and tok.encode("hi")[0] == 1 and tok.chat_template == "y"
    # without the flag, tokenizer.json's post-processor decides (here: one that adds BOS)
    spec = json.loads((root / "tokenizer.json").read_text())
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                              {"Sequence": {"id": "A", "type_id": 0}}], "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                              "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}
    (root / "tokenizer.json").write_text(json.dumps(spec))
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_hf_dir(root)
    assert tok.add_bos and tok.encode("hi") == [1] + tok.encode("hi", add_special_tokens=False)
    assert tok.encode("hi", add_special_tokens=False)[0] != 1


# -- errors ---------------------------------------------------------------------------------------------
def test_unsupported_gguf(tmp_path):
    bare = gguf.GGUFWriter(tmp_path / "bare.gguf", "llama")
    bare.write_header_to_file(); bare.write_kv_data_to_file(); bare.write_tensors_to_file(); bare.close()
    with pytest.raises(UnsupportedModelError, match="vocabulary"):
        Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "bare.gguf"))
    bert = gguf.GGUFWriter(tmp_path / "bert.gguf", "bert")
    bert.add_tokenizer_model("bert"); bert.add_token_list(["[PAD]", "a"])
    bert.write_header_to_file(); bert.write_kv_data_to_file(); bert.write_tensors_to_file(); bert.close()
    with pytest.raises(UnsupportedModelError, match="bert"):
        Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "bert.gguf"))


def test_hf_dir_errors(tmp_path):
    with pytest.raises(ModelNotFoundError):
        Tokenizer.from_hf_dir(tmp_path / "nope")
    (tmp_path / "tokenizer.model").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
