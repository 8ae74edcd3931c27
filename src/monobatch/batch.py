"""StepBatch: what one forward call computes (llama.cpp's ``llama_batch``).

A StepBatch is a flat list of tokens from any number of sequences. Each sequence contributes
one contiguous *chunk*: a prefill chunk of its prompt, or the single token of a decode. B=1 is not
a special case, and prefill chunks and decode tokens of different sequences share one call.

Layout (T tokens, 3 chunks; ``*`` marks rows that want logits)::

    token_ids  [ a0 a1 a2 a3 | b7 | c40 c41 ]      T = 7
    positions  [ 0  1  2  3  | 7  | 40  41  ]
    seq_ids    [ A  A  A  A  | B  | C   C   ]
    logit_rows [          3*,  4*,       6* ]      R = 3 (last token of each chunk that asks)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(slots=True)
class Chunk:
    """One sequence's contiguous run of tokens in a StepBatch (read-only by convention: nothing
    changes a built chunk).

    ``start`` is the offset in the flat batch, ``pos`` the position (= KV length before this
    step) of its first token, ``length`` its token count, ``token_ids`` its ids on the host (the
    prefix cache hashes them). ``all_logits``: every row of the chunk returns logits (prompt
    logprobs), not only the last.

    Not ``frozen``: a frozen dataclass sets each field through ``object.__setattr__``, 1.8 us a
    chunk against 0.34 (CPython 3.11), and a decode step builds one a row, twice with async
    scheduling (issue 16).
    """

    seq_id: int
    start: int
    pos: int
    length: int
    wants_logits: bool
    token_ids: tuple[int, ...] = ()
    all_logits: bool = False

    @property
    def end_pos(self) -> int:
        """KV length of the sequence after this step (tokens)."""
        return self.pos + self.length


@dataclass(slots=True)
class StepBatch:
    """Flat tokens of one step and the rows that want logits.

    Attributes:
        token_ids: ``[T]`` int64 token ids, on the model's device (on the host for a decode step
            that a CUDA graph runs: ``Engine.build_batch``; :meth:`to` moves them).
        positions: ``[T]`` int64 positions, where ``token_ids`` are.
        seq_ids: ``[T]`` int64 sequence ids (host), llama_batch's ``seq_id``.
        logit_rows: ``[R]`` int64 indices into T whose logits are returned, ascending and without
            repeats (so R == T means every row, in order: the model then skips the gather),
            where ``token_ids`` are.
        chunks: the contiguous per-sequence runs, in batch order.
        row_tile: 0 in the default (fast) mode. In deterministic mode, N > 0: every row-wise
            operation (norms, GEMMs, activations) runs on tiles of exactly N rows and attention
            one query row at a time, so a token's result does not depend on the batch.
        row_pad: with ``row_tile``, whether the last tile is zero-padded to N rows (True), or
            not, for a model whose row-wise ops compute each row alone by construction
            (``DecoderModel.rows_independent``; the engine decides).
        position_bound: every position is below it (known on the host, so the model may read
            RoPE from its table without a device check); None when unknown.
        decode_only: :attr:`is_decode_only`, when known at the batch's construction (None: found
            from the chunks on each read).
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    seq_ids: torch.Tensor
    logit_rows: torch.Tensor
    chunks: tuple[Chunk, ...]
    row_tile: int = 0
    position_bound: int | None = None
    decode_only: bool | None = None
    row_pad: bool = True

    @property
    def num_tokens(self) -> int:
        """T, the tokens computed in this step."""
        return int(self.token_ids.shape[0])

    @property
    def is_decode_only(self) -> bool:
        """True when every chunk is one token that wants logits (the CUDA-graph-capturable case)."""
        if self.decode_only is not None:  # set by build: a step reads it several times
            return self.decode_only
        return all(c.length == 1 and c.wants_logits for c in self.chunks)

    @classmethod
    def build(
        cls,
        chunks: Sequence[tuple],
        device: torch.device | str = "cpu",
        row_tile: int = 0,
        row_pad: bool = True,
    ) -> "StepBatch":
        """Build from ``(seq_id, token_ids, first_position, wants_logits[, all_logits])`` per
        sequence.

        The logit row of a chunk is its last token (every token with ``all_logits``). A sequence
        may appear at most once.
        ``row_tile``, ``row_pad``: see the class attributes (0 = fast mode).

        Raises:
            ValueError: an empty chunk, a negative position, or a sequence listed twice.
        """
        tokens: list[int] = []
        positions: list[int] = []
        seq_ids: list[int] = []
        rows: list[int] = []
        built: list[Chunk] = []
        decode_only = True
        for chunk in chunks:
            seq_id, ids, pos, wants = chunk[0], chunk[1], chunk[2], chunk[3]
            every = len(chunk) > 4 and bool(chunk[4])
            n = len(ids)
            if not n:
                raise ValueError(f"empty chunk for sequence {seq_id}")
            if pos < 0:
                raise ValueError(f"negative position for sequence {seq_id}")
            start = len(tokens)
            if n == 1:  # a decode row (most of a large batch's chunks): no ranges or list copies
                tokens.append(ids[0])
                positions.append(pos)
                seq_ids.append(seq_id)
                if wants or every:
                    rows.append(start)
                decode_only = decode_only and wants
            else:
                tokens.extend(ids)
                positions.extend(range(pos, pos + n))
                seq_ids.extend([seq_id] * n)
                if every:
                    rows.extend(range(start, start + n))
                elif wants:
                    rows.append(start + n - 1)
                decode_only = False
            built.append(Chunk(seq_id, start, pos, n, wants, ids if type(ids) is tuple else tuple(ids), every))
        if len({c.seq_id for c in built}) < len(built):  # one set for the batch, not a check a row
            listed = [c.seq_id for c in built]
            twice = next(s for s in listed if listed.count(s) > 1)
            raise ValueError(f"sequence {twice} appears twice in one StepBatch")
        return cls(
            token_ids=torch.tensor(tokens, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            seq_ids=torch.tensor(seq_ids, dtype=torch.int64),
            logit_rows=torch.tensor(rows, dtype=torch.int64),
            chunks=tuple(built),
            row_tile=row_tile,
            position_bound=max(positions) + 1 if positions else 0,  # = the chunks' largest end_pos
            decode_only=decode_only,
            row_pad=row_pad,
        ).to(device)

    def to(self, device: torch.device | str) -> "StepBatch":
        """This batch with ``token_ids``, ``positions`` and ``logit_rows`` on ``device`` (itself
        when they are there already). To CUDA it is one asynchronous copy from page-locked memory:
        ``torch.tensor(..., device=)`` copies synchronously, i.e. the host would wait until the GPU
        has run everything queued before it, the previous step included (async scheduling would
        overlap nothing)."""
        device, here = torch.device(device), self.token_ids.device
        if here.type == device.type and device.index in (None, here.index):  # "cuda" is wherever it is
            return self
        T = self.num_tokens
        flat = torch.cat((self.token_ids, self.positions, self.logit_rows))
        if device.type == "cuda" and not flat.is_cuda:
            flat = flat.pin_memory().to(device, non_blocking=True)
        else:
            flat = flat.to(device)
        token_ids, positions, logit_rows = flat.split([T, T, self.logit_rows.shape[0]])
        return StepBatch(token_ids, positions, self.seq_ids, logit_rows, self.chunks, self.row_tile, self.position_bound,
                         self.decode_only, self.row_pad)
