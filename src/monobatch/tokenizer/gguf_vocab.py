"""GGUF vocabularies as ``tokenizers.Tokenizer`` objects, following llama.cpp's llama-vocab.cpp.

* ``gpt2`` (byte-level BPE): vocab + merges, text split by the regexes llama.cpp lists for
  ``tokenizer.ggml.pre`` (:data:`PRE_SPLITS`, each applied to the pieces of the one before), then
  mapped to GPT-2's byte alphabet.
* ``llama`` (SentencePiece BPE): byte fallback, merges from the file or from the scores
  (transformers' GGUF converter), llama.cpp's space prefix.

Control and unknown tokens become special added tokens, user-defined ones plain added tokens.
"""

from __future__ import annotations

import logging

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from monobatch.errors import UnsupportedModelError

log = logging.getLogger(__name__)

#: gguf.TokenType values.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4

# -- llama.cpp llama-vocab.cpp: the regexes of each BPE pre-tokenizer, applied in order ---------
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
# Tekken and GPT-4o: the regexes of their tokenizer.json (llama.cpp rewrites the \p{Lu}-style
# classes with lookaheads only because its engine lacks them; Oniguruma has them).
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"

PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "starcoder": (r"\p{N}", _GPT2),  # digits one by one, then GPT-2
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
    "deepseek-v3": (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "tekken": (_TEKKEN,),
    "gpt-4o": (_GPT4O,),
    "bloom": (_BLOOM,),
    "viking": (_BLOOM, r"\p{N}"),
}
#: ``tokenizer.ggml.pre`` value -> regex family (llama.cpp's name -> LLAMA_VOCAB_PRE_TYPE table).
PRE_FAMILY: dict[str, str] = {
    **dict.fromkeys(["", "default"], "default"),
    **dict.fromkeys(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "mpt", "olmo", "jais", "exaone4", "trillion", "granite-docling",
                     "roberta-bpe", "jina-v1-en", "jina-v2-code"], "gpt2"),
    **dict.fromkeys(["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"],
                    "starcoder"),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe", "glm4", "chatglm-bpe"], "llama3"),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan"], "qwen2"),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], "gpt-4o"),
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense"], "deepseek-v3"),
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], "bloom"),
    "falcon": "falcon", "deepseek-coder": "deepseek-coder", "tekken": "tekken", "viking": "viking",
}
#: Pre-tokenizers for which llama.cpp sets add_bos (when the file does not say) and ignore_merges.
ADD_BOS_PRE = frozenset(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                          "lfm2", "jina-v5-nano", "tekken", "chameleon"])
IGNORE_MERGES_PRE = ADD_BOS_PRE - {"chameleon"}


# -- GGUF vocabularies -----------------------------------------------------------------------------
def byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> tokenizers.Tokenizer:
    """Byte-level BPE with llama.cpp's regex split for ``pre`` (GPT-2's, with a warning, if unknown)."""
    family = PRE_FAMILY.get(pre)
    if family is None:
        log.warning("unknown GGUF pre-tokenizer %r: splitting text with GPT-2's regex", pre)
        family = "gpt2"
    elif not pre:
        log.warning("the GGUF names no pre-tokenizer: using llama.cpp's 'default' (quality may suffer)")
    try:
        model = BPE({tok: i for i, tok in enumerate(tokens)}, [tuple(m.split(" ", 1)) for m in merges],
                    ignore_merges=pre in IGNORE_MERGES_PRE)
    except Exception as exc:
        raise UnsupportedModelError(f"cannot build the BPE vocabulary from the GGUF: {exc}") from exc
    backend = tokenizers.Tokenizer(model)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_SPLITS[family]]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], merges: list[str] | None,
                       add_space_prefix: bool) -> tokenizers.Tokenizer:
    """SentencePiece BPE: merges from the file, else from the scores (transformers' GGUF converter)."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges] if merges else merges_from_scores(vocab, tokens, scores)
    unk = next((tok for tok, kind in zip(tokens, types) if kind == UNKNOWN), None)
    try:
        backend = tokenizers.Tokenizer(BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    except Exception as exc:
        raise UnsupportedModelError(f"cannot build the SentencePiece vocabulary from the GGUF: {exc}") from exc
    spaces = [normalizers.Replace(" ", "▁")]
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), *spaces] if add_space_prefix else spaces)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if add_space_prefix else steps)
    return backend


def merges_from_scores(vocab: dict[str, int], tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two vocab pieces, best merged-piece score first.

    transformers ``generate_merges`` (used by its GGUF converter), specialised to scores.
    """
    merges = []
    for piece, score in dict(zip(tokens, scores)).items():
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def add_special_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens -> special added tokens; user-defined -> plain added tokens."""
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if t and k in (CONTROL, UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if t and k == USER_DEFINED]
    backend.add_special_tokens(special)
    backend.add_tokens(user)
