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

Chat prompts are the exception: in :meth:`Tokenizer.encode_chat` the text of the messages (and of
``tools`` and the other template variables) is data, so special-token text typed there is
tokenized as plain text; only the template's own scaffolding yields control tokens.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading
from pathlib import Path
from typing import Any, Sequence

import tokenizers
from tokenizers import pre_tokenizers

from monobatch.errors import InvalidRequestError, ModelNotFoundError, UnsupportedModelError, require_utf8
from monobatch.tokenizer import gguf_vocab
from monobatch.tokenizer.chat_template import ChatTemplate

log = logging.getLogger(__name__)

#: Chat end tokens (llama.cpp's end-of-generation name list, plus ``</s>`` and DeepSeek's).
_EOG_NAMES = frozenset(["<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
                        "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
                        "<end_of_utterance>", "</s>", "<｜end▁of▁sentence｜>"])

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

#: Placeholder brackets for special-token text found in chat data (Supplementary Private Use
#: Area-A: not whitespace, no case, kept as is by ``tojson``), around ``nonce:index`` in digits.
_MARK_OPEN, _MARK_CLOSE = "\U000F0000", "\U000F0001"
#: An added token of the plain-text copy of the backend only: text after it encodes as the text
#: after a special token (a cut), and it is dropped from the ids.
_MARK_CUT = "\U000F0002"
#: Template variables that are the tokenizer's own token texts, not data.
_SCAFFOLDING_VARS = frozenset({"bos_token", "eos_token"})


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
        # special-token texts as the backend matches them: leftmost, then longest first
        texts = sorted({tok.content for tok in added.values() if tok.special and tok.content}, key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._anchor = _cut_anchor(backend, added)
        self._plain_backend: tuple[tokenizers.Tokenizer, int] | None = None
        self._plain_lock = threading.Lock()
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

        This is a raw prompt's tokenization (``/v1/completions``, ``LLM.generate``, ``generate``
        without ``--chat``): like llama.cpp's server (``parse_special=true``) it parses special
        tokens anywhere in the text, so whoever writes a raw prompt writes its control tokens too.
        Chat messages are tokenized by :meth:`encode_chat`, where typed special-token text is data.

        Args:
            text: the text.
            add_special_tokens: prepend BOS when ``add_bos`` -- unless the ids already start
                with BOS (the text began with the BOS text): never two BOS (field case F2).

        Returns:
            The ids.

        Raises:
            InvalidRequestError: ``text`` is not valid UTF-8 (a lone surrogate; param ``prompt``).
        """
        require_utf8(text, "prompt")
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

        Message text is data. Special-token text (``"<|im_end|>"``, ``"<|im_start|>"``, any
        token the tokenizer marks special) that appears in a message -- its ``content`` for any
        role, string or text parts, ``name``, ``tool_call_id``, the names and arguments of
        ``tool_calls``, any other string in it -- or in a template variable of ``kwargs``
        (``tools``, ``documents``, ...) is tokenized as plain text, never as the control token:
        a user cannot close their turn and open a system turn by typing the markers. Only the
        template's scaffolding (and ``bos_token`` / ``eos_token``) yields control tokens.

        Without such text in the data the ids are exactly ``encode(apply_chat_template(...))``,
        the ids of the rendered prompt sent to ``/v1/completions`` (F2). With it, the template
        renders the data with each occurrence replaced by a placeholder (private-use characters
        around a per-call random nonce and an index); the rendered text is cut at the
        placeholders, each piece between them is encoded as :meth:`encode` would (special tokens
        parsed: it is scaffolding, and a piece after a cut is encoded as the text after a special
        token), and each placeholder is its original text encoded with special-token matching off
        (``tokenizers``' ``encode_special_tokens`` on a copy of the backend; also encoded as text
        after a cut, and never to a special id even where merges could build one). Cutting there
        changes nothing else: tokenization cuts at a special token's text anyway. Added tokens
        that are not special (GGUF user-defined tokens, e.g. ``<think>`` in some vocabularies)
        are ordinary vocabulary and still match in data, as in any text; so do special tokens
        the template's filters create out of other text (``|lower``, two fields joined). A
        filter the template applies to a string (``|upper``, ``|e``) does not reach the typed
        special-token text in it: that text goes in as typed.

        Args:
            messages: OpenAI-style messages (see ``chat_template.normalize_messages``).
            add_generation_prompt: end with the assistant header.
            **kwargs: extra template variables (data, as the messages are).

        Returns:
            The prompt ids.

        Raises:
            InvalidRequestError: as :meth:`apply_chat_template`; text that is not valid UTF-8
                (a lone surrogate; param ``messages``); also a template that cuts
                through or escapes special-token text of the data (the placeholders come back
                broken), which cannot be tokenized safely.
        """
        rendered = self.apply_chat_template(messages, add_generation_prompt, **kwargs)  # errors show the real text
        require_utf8(rendered, "messages", "the chat prompt (messages, tools)")
        if self._special_text is None:
            return self.encode(rendered)
        nonce = f"{secrets.randbits(64):020d}"
        originals: list[str] = []

        def hide(match: re.Match) -> str:
            originals.append(match.group(0))
            return f"{_MARK_OPEN}{nonce}:{len(originals) - 1}{_MARK_CLOSE}"

        safe_messages = _map_strings(messages, lambda text: self._special_text.sub(hide, text))
        safe_kwargs = {key: value if key in _SCAFFOLDING_VARS else
                       _map_strings(value, lambda text: self._special_text.sub(hide, text))
                       for key, value in kwargs.items()}
        if not originals:
            return self.encode(rendered)
        try:
            safe = self.apply_chat_template(safe_messages, add_generation_prompt, **safe_kwargs)
        except InvalidRequestError as exc:  # a template that reacts to the placeholders: show the real text
            message = re.sub(re.escape(f"{_MARK_OPEN}{nonce}:") + r"(\d+)" + re.escape(_MARK_CLOSE),
                             lambda m: originals[int(m.group(1))], str(exc))
            raise InvalidRequestError(message, param=exc.param) from exc
        return self._encode_cut(safe, nonce, originals, rendered)

    def _encode_cut(self, safe: str, nonce: str, originals: list[str], rendered: str) -> list[int]:
        """Encode the placeholder-rendered prompt ``safe``: scaffolding pieces with special tokens
        parsed, each placeholder as its original text without (see :meth:`encode_chat`)."""
        parts = re.split(re.escape(f"{_MARK_OPEN}{nonce}:") + r"(\d+)" + re.escape(_MARK_CLOSE), safe)
        pieces, hidden = parts[0::2], [int(i) for i in parts[1::2]]
        marks = rendered.count(_MARK_OPEN) + rendered.count(_MARK_CLOSE)  # typed by the user: plain data
        if (any(i >= len(originals) for i in hidden) or any(nonce in p for p in pieces)
                or sum(p.count(_MARK_OPEN) + p.count(_MARK_CLOSE) for p in pieces) > marks):
            raise InvalidRequestError("the chat template changed special-token text inside the messages (cut or "
                                      "escaped it), so the prompt cannot be tokenized with that text kept as plain "
                                      "text; remove the special-token text from the messages", param="messages")
        # a piece after a cut follows an anchor special token, as it would follow the special
        # token's text in the rendered prompt (a SentencePiece "first" space prefix stays off)
        anchor_id, anchor_text = self._anchor or (None, "")
        texts = [p if k == 0 or not p else anchor_text + p for k, p in enumerate(pieces)]
        encoded = [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=False)]
        for k in range(1, len(encoded)):
            if pieces[k] and anchor_text:
                if encoded[k][:1] == [anchor_id]:
                    encoded[k] = encoded[k][1:]
                else:  # cannot happen with a checked anchor; encode the piece alone
                    encoded[k] = self._backend.encode_batch([pieces[k]], add_special_tokens=False)[0].ids
        at_start = not pieces[0]  # the first placeholder opens the prompt
        plain = self._plain_ids([(originals[i], at_start and n == 0) for n, i in enumerate(hidden)])
        ids = list(encoded[0])
        for n, piece_ids in enumerate(encoded[1:]):
            ids += plain[n]
            ids += piece_ids
        if self.add_bos and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def _plain_ids(self, items: list[tuple[str, bool]]) -> list[list[int]]:
        """Each ``(text, at_start)`` tokenized as plain text: no special-token matching, encoded
        as the text after a cut unless ``at_start``. Never a special id: should the vocabulary's
        merges build one out of plain text, the text is encoded one character at a time.

        Raises:
            InvalidRequestError: even single characters give a special id.
        """
        backend, cut_id = self._plain()
        distinct = sorted(set(items))
        batch = [text if at_start else _MARK_CUT + text for text, at_start in distinct]
        out = {}
        for (text, at_start), enc in zip(distinct, backend.encode_batch(batch, add_special_tokens=False)):
            ids = [i for i in enc.ids if i != cut_id]
            if any(i in self._special_ids for i in ids):
                spread = ("" if at_start else _MARK_CUT) + _MARK_CUT.join(text)
                ids = [i for i in backend.encode_batch([spread], add_special_tokens=False)[0].ids if i != cut_id]
                if any(i in self._special_ids for i in ids):
                    raise InvalidRequestError(f"the text {text!r} in the messages cannot be tokenized as plain text "
                                              "(this vocabulary only has its special token for it)", param="messages")
            out[text, at_start] = ids
        return [out[item] for item in items]

    def _plain(self) -> tuple[tokenizers.Tokenizer, int]:
        """A copy of the backend that tokenizes special-token text as plain text, and the id of
        its cut mark (an added token of the copy only, dropped from every result). Made on first
        use; added tokens that are not special still match."""
        with self._plain_lock:
            if self._plain_backend is None:
                plain = tokenizers.Tokenizer.from_str(self._backend.to_str())
                plain.encode_special_tokens = True
                plain.add_tokens([tokenizers.AddedToken(_MARK_CUT, special=False, normalized=False)])
                self._plain_backend = (plain, plain.token_to_id(_MARK_CUT))
            return self._plain_backend


def _map_strings(value: Any, fn) -> Any:
    """``value`` with ``fn`` applied to every string in it (dict keys too), through dicts, lists
    and tuples; new containers, the caller's are not modified; other values as they are."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(v, fn) for v in value)
    return value


def _cut_anchor(backend: tokenizers.Tokenizer, added: dict) -> tuple[int, str] | None:
    """A special token whose text encodes to itself alone and does not strip its neighbours'
    whitespace: text after it encodes as text after any cut at a special token. None if none."""
    for token_id, tok in sorted(added.items()):
        if tok.special and tok.content and not (tok.lstrip or tok.rstrip or tok.single_word or tok.normalized):
            if backend.encode(tok.content, add_special_tokens=False).ids == [token_id]:
                return token_id, tok.content
    return None


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
