"""Streaming detokenization: generated token ids in, UTF-8-safe text pieces out.

Each token's raw bytes (:meth:`Tokenizer.token_bytes`) go through one incremental UTF-8 decoder,
so a character whose bytes are split across tokens (emoji, CJK, accents) is emitted once its
last byte arrives, and never half of it. The work per token is O(its bytes) -- nothing is
decoded twice, unlike the prefix/read-offset windows of vLLM and TGI, which re-decode a few
tokens each step.

The invariant (field case T1): ``"".join(push(t) for t in ids) + flush()`` equals
``tokenizer.decode(ids, skip_special_tokens)`` for the generated ids. Two documented exceptions,
both outside byte-level vocabularies like the bundled SmolLM2's:

* SentencePiece: ``decode`` drops the first space of a whole text (HF's ``Strip`` decoder);
  a continuation keeps it, so a first token ``"▁Hello"`` streams as ``" Hello"``.
* Invalid bytes: the stream puts one U+FFFD per maximal invalid subsequence (Python's and Rust's
  ``from_utf8_lossy`` rule); ``tokenizers``' ByteFallback decoder puts one per byte token.

Text never depends on the prompt: byte-level and byte-fallback tokens decode without context.
"""

from __future__ import annotations

import codecs
from typing import Sequence

from monobatch.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text, one token at a time.

    Args:
        tokenizer: the model's tokenizer.
        prompt_ids: the prompt's ids. Accepted for the engine's convenience; the text of the
            generated tokens does not depend on them (see the module docstring).
        skip_special_tokens: leave special tokens (``<|im_end|>``, ``<|endoftext|>`` ...) out of
            the text, as ``Tokenizer.decode`` does.

    Attributes:
        tokenizer: the tokenizer (the stop and DRY logic read ``token_bytes`` from it).
        text: all text emitted so far (pushes and flush); joined lazily, so O(1) per push.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._pieces: list[str] = []
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._clean = True  # the decoder holds no bytes of an incomplete character

    def push(self, token_id: int) -> str:
        """Add one generated token.

        Args:
            token_id: the token sampled this step.

        Returns:
            The text that became complete with this token: "" while a multi-byte character is
            still incomplete, or for a skipped special token.

        Raises:
            InvalidRequestError: ``token_id`` is outside the vocabulary.
        """
        if self.skip_special_tokens and self.tokenizer.is_special(token_id):
            return ""
        raw = self.tokenizer.token_bytes(token_id)
        if self._clean and raw.isascii():  # whole characters, nothing held: the decoder's result, without it
            piece = raw.decode("ascii")  # (its Python-level decode costs ~0.5 us a token, issue 16)
        else:
            piece = self._utf8.decode(raw)
            self._clean = not self._utf8.getstate()[0]
        if piece:
            self._pieces.append(piece)
        return piece

    def flush(self) -> str:
        """End the stream: bytes of a character left incomplete become U+FFFD.

        Returns:
            The held-back text ("" when every character was complete).
        """
        piece = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        self._clean = True
        if piece:
            self._pieces.append(piece)
        return piece

    @property
    def text(self) -> str:
        """All text emitted so far (pushes and flush), joined on demand."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""
