"""Tokenizer: text <-> token ids for a GGUF file or a Hugging Face folder, plus chat prompts.

Every tokenizer is a ``tokenizers.Tokenizer`` (the HF Rust library); this module only assembles
one from what a checkpoint stores and adds the conventions around it (BOS, end-of-generation ids,
raw token bytes, chat templates).

GGUF vocabularies follow llama.cpp (src/llama-vocab.cpp), which is what GGUF models are run with:

* ``gpt2`` (byte-level BPE): vocab + merges; the text is split by the regexes llama.cpp lists for
  ``tokenizer.ggml.pre`` (:data:`monobatch.tokenizer.gguf_vocab.PRE_SPLITS`), each applied to the pieces of the one before,
  then mapped to GPT-2's byte alphabet. ``smollm`` splits every digit first, as SmolLM2's own
  ``tokenizer.json`` does (``Digits(individual_digits=True)`` before the GPT-2 regex).
* ``llama`` (SentencePiece BPE): a BPE with byte fallback whose merges come from the scores,
  built like transformers' GGUF converter. The space prefix follows llama.cpp and SentencePiece
  (``add_space_prefix``): every stretch of text, at the start or after a special token, gets one
  ``▁``, even when it already starts with a space (HF's ``Metaspace`` would skip that one).

Control tokens (and the unknown token) become special added tokens, user-defined tokens plain
added tokens, so ``"<|im_start|>"`` in a prompt encodes to one id, as llama.cpp does with
``parse_special=true``. ``decode`` is the library's; ``token_bytes`` mirrors its decoder per token.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Sequence

import tokenizers
from tokenizers import pre_tokenizers

from monobatch.errors import InvalidRequestError, ModelNotFoundError, UnsupportedModelError
from monobatch.tokenizer import gguf_vocab
from monobatch.tokenizer.chat_template import ChatTemplate

log = logging.getLogger(__name__)

#: Chat end tokens (llama.cpp's end-of-generation name list, plus ``</s>`` and DeepSeek's).
_EOG_NAMES = frozenset(["<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
                        "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
                        "<end_of_utterance>", "</s>", "<｜end▁of▁sentence｜>"])

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` table, inverted: alphabet character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _gpt2_byte_decoder()


class Tokenizer:
    """Text <-> token ids, special ids and the chat template of one model.

    Build one with :meth:`from_gguf` or :meth:`from_hf_dir`.

    Attributes:
        vocab_size: number of token ids (the model's embedding rows for a GGUF).
        bos_id / eos_id: the BOS and EOS ids, or None when the checkpoint has none.
        eog_ids: every id that ends a generation: EOS, GGUF ``eot``/``eom`` ids, the
            ``generation_config.json`` EOS list, and special tokens named like a chat end token.
        add_bos: whether :meth:`encode` prepends BOS (checkpoint flag, else llama.cpp's default).
        chat_template: the jinja2 chat template text, or None.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, vocab_size: int, bos_id: int | None,
                 eos_id: int | None, extra_eog_ids: Sequence[int] = (), add_bos: bool,
                 chat_template: str | None, decoder_kind: str) -> None:
        self._backend = backend
        self.vocab_size = vocab_size
        self.bos_id = bos_id if bos_id is not None and 0 <= bos_id < vocab_size else None
        self.eos_id = eos_id if eos_id is not None and 0 <= eos_id < vocab_size else None
        self.add_bos = bool(add_bos) and self.bos_id is not None
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        named = {i for i, tok in added.items() if tok.content in _EOG_NAMES}
        eog = {self.eos_id, *extra_eog_ids, *named}
        self.eog_ids = frozenset(i for i in eog if i is not None and 0 <= i < vocab_size)
        self._decoder_kind = decoder_kind  # "byte_level" | "sentencepiece" | "text"
        self._bytes: list[bytes | None] = [None] * vocab_size
        self.chat_template: str | None = chat_template or None
        self._template: ChatTemplate | None = None

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, reader: Any) -> "Tokenizer":
        """Build the tokenizer a GGUF file describes (llama.cpp ``llama_vocab::load`` semantics).

        Args:
            reader: an open ``gguf.GGUFReader``.

        Returns:
            The tokenizer; ``add_bos`` is ``tokenizer.ggml.add_bos_token``, else llama.cpp's
            default (True for ``llama``, and for ``gpt2`` with a Llama-3-like ``pre``).

        Raises:
            UnsupportedModelError: no vocabulary, or a tokenizer model other than gpt2/llama.
        """
        def kv(key: str, default: Any = None) -> Any:
            field = reader.fields.get(key)
            return default if field is None else field.contents()

        model, tokens = kv("tokenizer.ggml.model"), kv("tokenizer.ggml.tokens")
        if not model or not tokens:
            raise UnsupportedModelError("the GGUF has no tokenizer vocabulary (tokenizer.ggml.tokens)")
        types = kv("tokenizer.ggml.token_type") or [gguf_vocab.NORMAL] * len(tokens)
        merges = kv("tokenizer.ggml.merges")
        if model == "gpt2":
            pre = kv("tokenizer.ggml.pre", "")
            backend = gguf_vocab.byte_level_bpe(tokens, merges or [], pre)
            add_bos_default, kind, default_ids = pre in gguf_vocab.ADD_BOS_PRE, "byte_level", (None, None)
        elif model == "llama":
            scores = kv("tokenizer.ggml.scores") or [0.0] * len(tokens)
            backend = gguf_vocab.sentencepiece_bpe(tokens, scores, types, merges, kv("tokenizer.ggml.add_space_prefix", True))
            add_bos_default, kind, default_ids = True, "sentencepiece", (1, 2)  # llama.cpp's SPM defaults
        else:
            raise UnsupportedModelError(f"GGUF tokenizer model {model!r} is not supported (gpt2 and llama are)")
        gguf_vocab.add_special_tokens(backend, tokens, types)
        extra_eog = [kv("tokenizer.ggml.eot_token_id"), kv("tokenizer.ggml.eom_token_id")]
        return cls(backend, vocab_size=len(tokens), bos_id=kv("tokenizer.ggml.bos_token_id", default_ids[0]),
                   eos_id=kv("tokenizer.ggml.eos_token_id", default_ids[1]),
                   extra_eog_ids=[i for i in extra_eog if i is not None],
                   add_bos=kv("tokenizer.ggml.add_bos_token", add_bos_default),
                   chat_template=kv("tokenizer.chat_template"), decoder_kind=kind)

    @classmethod
    def synthetic(cls, vocab_size: int) -> "Tokenizer":
        """A word-level vocabulary ``<0>`` .. ``<V-1>`` for random-weight benchmarks
        (``--dummy-weights``): real encode/decode, no special tokens, no chat template."""
        from tokenizers.models import WordLevel

        backend = tokenizers.Tokenizer(WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return cls(backend, vocab_size=vocab_size, bos_id=None, eos_id=None, add_bos=False,
                   chat_template=None, decoder_kind="text")

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load a Hugging Face tokenizer folder.

        Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (``add_bos_token``,
        ``bos_token``, ``eos_token``, ``chat_template``), ``chat_template.jinja`` (wins over the
        config's template, as in transformers), ``special_tokens_map.json`` and
        ``generation_config.json`` (its ``eos_token_id`` list joins ``eog_ids``, e.g. Llama 3).
        Without ``add_bos_token``, ``add_bos`` is whether ``tokenizer.json``'s post-processor
        adds BOS. The post-processor itself is never run: :meth:`encode` adds BOS and nothing else.

        Raises:
            ModelNotFoundError: ``path`` is not a folder.
            UnsupportedModelError: no ``tokenizer.json`` (``tokenizer.model`` alone is not read).
        """
        root = Path(path)
        if not root.is_dir():
            raise ModelNotFoundError(f"no model folder at {str(root)!r}")
        if not (root / "tokenizer.json").is_file():
            raise UnsupportedModelError(f"{str(root)!r} has no tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
        config, special_map = _read_json(root / "tokenizer_config.json"), _read_json(root / "special_tokens_map.json")
        gen = _read_json(root / "generation_config.json")
        gen_eos = gen.get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])

        def special_id(name: str, fallback: int | None) -> int | None:
            source = config if name in config else special_map
            if name not in source:
                return fallback
            text = _token_content(source[name])  # an explicit null (Qwen's bos_token) means none
            return backend.token_to_id(text) if text else None

        bos_id = special_id("bos_token", gen.get("bos_token_id"))
        eos_id = special_id("eos_token", gen_eos[0] if gen_eos else None)
        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            add_bos = _post_processor_adds(backend, bos_id)
        vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        return cls(backend, vocab_size=vocab_size, bos_id=bos_id, eos_id=eos_id, extra_eog_ids=gen_eos,
                   add_bos=add_bos, chat_template=_hf_chat_template(root, config),
                   decoder_kind=_decoder_kind(backend))

    # -- text <-> ids ---------------------------------------------------------------------------
    @property
    def bos_text(self) -> str | None:
        """The BOS token's text (what ``{{ bos_token }}`` renders), or None."""
        return None if self.bos_id is None else self._backend.id_to_token(self.bos_id)

    @property
    def eos_text(self) -> str | None:
        """The EOS token's text (what ``{{ eos_token }}`` renders), or None."""
        return None if self.eos_id is None else self._backend.id_to_token(self.eos_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token text such as ``"<|im_start|>"`` becomes its id.

        Args:
            text: the text (llama.cpp ``parse_special=true``).
            add_special_tokens: prepend BOS when ``add_bos`` -- unless the ids already start
                with BOS (the text began with the BOS text): never two BOS (field case F2).

        Returns:
            The ids.
        """
        # encode_batch releases the GIL (encode holds it for the whole call): the server tokenizes
        # on worker threads, and its event loop keeps serving other clients meanwhile
        ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (the ``tokenizers`` decoder, so it equals HF's ``decode``).

        Invalid UTF-8 becomes U+FFFD. A SentencePiece vocabulary with a space prefix drops the
        text's first space (HF's ``Strip`` decoder); :class:`IncrementalDetokenizer` keeps it.

        Args:
            ids: token ids.
            skip_special_tokens: leave control tokens such as ``<|im_end|>`` out.

        Raises:
            InvalidRequestError: an id outside ``[0, vocab_size)``.
        """
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise InvalidRequestError(f"token ids must be in [0, {self.vocab_size})", param="tokens")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token: what its text contributes to a decoded string.

        Byte-level tokens map through GPT-2's byte alphabet, SentencePiece ``<0xNN>`` tokens are
        their byte and ``▁`` is a space; a special token is its own text. Joining the bytes of
        several tokens and decoding as UTF-8 gives their :meth:`decode` text (except the dropped
        SentencePiece prefix space, and U+FFFD counts on invalid bytes).

        Raises:
            InvalidRequestError: ``token_id`` outside ``[0, vocab_size)``.
        """
        if not 0 <= token_id < self.vocab_size:
            raise InvalidRequestError(f"token id {token_id} is not in [0, {self.vocab_size})", param="tokens")
        cached = self._bytes[token_id]
        if cached is None:
            cached = self._bytes[token_id] = self._compute_bytes(token_id)
        return cached

    def token_text(self, token_id: int) -> str:
        """One token as text: its :meth:`token_bytes` as UTF-8, an incomplete sequence shown as
        U+FFFD (the ``token`` of OpenAI's logprobs).

        Raises:
            InvalidRequestError: as :meth:`token_bytes`.
        """
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def _compute_bytes(self, token_id: int) -> bytes:
        text = self._backend.id_to_token(token_id)
        if text is None:
            return b""
        if self._decoder_kind == "byte_level":
            # tokenizers' ByteLevel decoder: a token wholly in the alphabet maps back to bytes;
            # any other (an added token such as "<｜end▁of▁sentence｜>") is taken as UTF-8 text.
            if all(c in _BYTE_DECODER for c in text):
                return bytes(_BYTE_DECODER[c] for c in text)
            return text.encode("utf-8")
        if self._decoder_kind == "sentencepiece":
            byte = _BYTE_TOKEN.fullmatch(text)
            return bytes([int(byte.group(1), 16)]) if byte else text.replace("▁", " ").encode("utf-8")
        return self._backend.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def backend_json(self) -> str:
        """The ``tokenizers`` tokenizer serialized as tokenizer.json text (for the grammar
        engine, which tokenizes and maps token bytes the same way)."""
        return self._backend.to_str()

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special (control) token, which ``skip_special_tokens`` drops."""
        return token_id in self._special_ids

    # -- chat -----------------------------------------------------------------------------------
    def set_chat_template(self, template: str) -> None:
        """Replace the checkpoint's chat template (``--chat-template`` / ``--chat-template-file``).

        Raises:
            InvalidRequestError: the template does not compile.
        """
        self._template = ChatTemplate(template)
        self.chat_template = template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` with the chat template (HF ``apply_chat_template(tokenize=False)``).

        Args:
            messages: OpenAI-style messages (see ``chat_template.normalize_messages``).
            add_generation_prompt: end with the assistant header.
            **kwargs: extra template variables.

        Raises:
            InvalidRequestError: no chat template, malformed messages, ``raise_exception``,
                a rendering error.
        """
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template; pass --chat-template or use "
                                      "/v1/completions", param="messages")
        if self._template is None or self._template.source != self.chat_template:
            self._template = ChatTemplate(self.chat_template)
        variables = {"bos_token": self.bos_text, "eos_token": self.eos_text, **kwargs}
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, **variables)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Render ``messages`` and encode the prompt: one BOS at most (F2), per :meth:`encode`.

        Raises:
            InvalidRequestError: as :meth:`apply_chat_template`.
        """
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs))


# -- Hugging Face folders --------------------------------------------------------------------------
def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"cannot read {str(path)!r}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token entry of tokenizer_config.json: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def _hf_chat_template(root: Path, config: dict) -> str | None:
    """chat_template.jinja, else chat_template.json, else tokenizer_config's (named: "default")."""
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(root / "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def _post_processor_adds(backend: tokenizers.Tokenizer, bos_id: int | None) -> bool:
    """Whether tokenizer.json's post-processor prepends BOS (how HF decides without the flag)."""
    if bos_id is None:
        return False
    with_special, plain = backend.encode("a").ids, backend.encode("a", add_special_tokens=False).ids
    return with_special[:1] == [bos_id] and plain[:1] != [bos_id]


def _decoder_kind(backend: tokenizers.Tokenizer) -> str:
    """Which per-token byte rule mirrors the folder's decoder (see ``Tokenizer.token_bytes``)."""
    if backend.decoder is None:
        return "text"
    spec = backend.decoder.__getstate__().decode("utf-8")
    if '"ByteLevel"' in spec:
        return "byte_level"
    return "sentencepiece" if '"ByteFallback"' in spec or '"Metaspace"' in spec or "▁" in spec else "text"
