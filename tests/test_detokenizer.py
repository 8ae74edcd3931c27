"""IncrementalDetokenizer: streamed pieces equal one decode, never half a character (field case T1)."""

from __future__ import annotations

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monobatch.tokenizer import IncrementalDetokenizer, Tokenizer

# fixtures and helpers (tests/ is on sys.path via conftest.py)
from fixtures_tokenizer import smollm_reader, smollm_tokenizer, write_spm_gguf  # noqa: F401



HARD_TEXT = ["👨‍👩‍👧‍👦", "🏳️‍🌈", "👍🏽", "🇯🇵🇫🇷", "日本語のテキスト", "한국어", "e\u0301\u0323", "naïve café", "Ω≈ç√∫",
             "\u200d", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", " leading", "\n\n", "<|im_end|>", "x² ½"]
unicode_text = st.lists(st.one_of(st.sampled_from(HARD_TEXT), st.text(st.characters(codec="utf-8"), max_size=8)),
                        max_size=10).map("".join)


def stream(tokenizer, ids, skip_special_tokens=True, prompt_ids=()):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert detok.text == "".join(pieces)
    return pieces


@settings(max_examples=400, deadline=None)
@given(text=unicode_text, skip=st.booleans())
def test_t1_stream_equals_decode(smollm_tokenizer, text, skip):
    """T1: text encoded, fed one token at a time: the pieces join to decode(ids); no U+FFFD for
    valid text (SmolLM2's vocab cannot spell a few bytes, e.g. 0xF1, so such text is skipped)."""
    ids = smollm_tokenizer.encode(text)
    pieces = stream(smollm_tokenizer, ids, skip)
    assert "".join(pieces) == smollm_tokenizer.decode(ids, skip_special_tokens=skip)
    raw = b"".join(smollm_tokenizer.token_bytes(i) for i in ids)
    if raw == text.encode("utf-8") and "\ufffd" not in text:
        assert not any("\ufffd" in piece for piece in pieces)
        if not skip:
            assert "".join(pieces) == text
        assert pieces[-1] == ""  # nothing held back at the end of valid text


@settings(max_examples=400, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=30), skip=st.booleans())
def test_t1_random_ids_equal_decode(smollm_tokenizer, ids, skip):
    """Any ids, invalid UTF-8 included: the stream's U+FFFDs are exactly decode's."""
    assert "".join(stream(smollm_tokenizer, ids, skip)) == smollm_tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text", ["👨‍👩‍👧‍👦", "日本語", "🇯🇵", "é"])
def test_multibyte_character_is_held_until_complete(smollm_tokenizer, text):
    ids = smollm_tokenizer.encode(text)
    pieces = stream(smollm_tokenizer, ids)
    assert "".join(pieces) == text
    for piece, token in zip(pieces, ids):
        if not piece:  # a token ending mid-character emits nothing yet
            raw = smollm_tokenizer.token_bytes(token)
            assert raw and not raw.decode("utf-8", "ignore") == raw.decode("utf-8", "replace")


def test_split_emoji_emits_once(smollm_tokenizer):
    ids = smollm_tokenizer.encode("🎨")  # U+1F3A8: four bytes over several byte tokens
    assert len(ids) > 1
    pieces = stream(smollm_tokenizer, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and pieces[-2] == "🎨" and pieces[-1] == ""


def test_incomplete_tail_flushed(smollm_tokenizer):
    ids = smollm_tokenizer.encode("ok🎨")[:-1]  # stop one token short of the emoji's last byte
    detok = IncrementalDetokenizer(smollm_tokenizer)
    assert "".join(detok.push(i) for i in ids) == "ok"
    assert detok.flush() == "\ufffd" == smollm_tokenizer.decode(ids)[-1]
    assert detok.text == smollm_tokenizer.decode(ids)


def test_leading_space_kept(smollm_tokenizer):
    prompt = smollm_tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    generated = smollm_tokenizer.encode(" Hello there")  # first token "ĠHello"
    pieces = stream(smollm_tokenizer, generated, prompt_ids=prompt)
    assert pieces[0] == " Hello" and "".join(pieces) == " Hello there"
    full = smollm_tokenizer.decode(prompt + generated)
    assert full[len(smollm_tokenizer.decode(prompt)):] == "".join(pieces)


def test_special_tokens_skipped_or_kept(smollm_tokenizer):
    ids = smollm_tokenizer.encode("Done.<|im_end|>")
    assert "".join(stream(smollm_tokenizer, ids)) == "Done."
    assert "".join(stream(smollm_tokenizer, ids, skip_special_tokens=False)) == "Done.<|im_end|>"
    # a skipped special token between the bytes of one character does not break it
    emoji = smollm_tokenizer.encode("🎨")
    mixed = emoji[:1] + [2] + emoji[1:]
    assert "".join(stream(smollm_tokenizer, mixed)) == "🎨" == smollm_tokenizer.decode(mixed)


def test_sentencepiece_keeps_the_prefix_space(tmp_path):
    """SentencePiece: decode() drops a text's first space (HF Strip decoder); a continuation must
    not, so the stream differs from decode exactly there."""
    tok = Tokenizer.from_gguf(gguf.GGUFReader(write_spm_gguf(tmp_path / "s.gguf")))
    ids = tok.encode("Hello world, naïve 日本 😀", add_special_tokens=False)
    joined = "".join(stream(tok, ids))
    assert joined == " Hello world, naïve 日本 😀"
    assert joined[1:] == tok.decode(ids)
