"""Which rank owns which part of the model: heads, FFN columns and vocabulary rows in pieces.

A model is cut into ``S`` = ``num_key_value_heads`` fixed *pieces* along every sharded axis:
piece ``p`` is KV head ``p`` with its ``H/S`` query heads (one GQA group), FFN columns
``ffn[p]:ffn[p+1]`` and vocabulary rows ``vocab[p]:vocab[p+1]``. A rank owns a contiguous run of
pieces (the first ``S % N`` ranks one more), the same run on every axis. Splitting by whole GQA
groups keeps a rank's query heads with their KV head; the pieces are also the fixed reduction
order of the deterministic mode (ADR 0007): the row-parallel layers sum the S pieces' partial
products in piece order whatever the rank count, TP=1 included.

FFN boundaries fall on multiples of 32 columns (:data:`ALIGN`), the group of every packed layout
(ADR 0006), so the row-parallel down projection's K split never cuts a quantization group.
"""

from __future__ import annotations

from dataclasses import dataclass

from monobatch.errors import InvalidRequestError
from monobatch.models.args import ModelArgs

#: FFN piece boundaries are multiples of this (the packed layouts' 16/32-column groups divide it).
ALIGN = 32


def check_devices(device: str, first: int, world: int, visible: int) -> None:
    """Refuse ``world`` ranks on CUDA that the machine cannot hold: rank ``r`` runs on
    ``cuda:(first + r)`` (the driver's device, then the next ones), so ``first + world`` devices
    must be visible. CPU ranks share the CPU (any count).

    Raises:
        InvalidRequestError: too few CUDA devices (before any rank is spawned).
    """
    if device == "cuda" and first + world > visible:
        raise InvalidRequestError(
            f"--tensor-parallel-size {world} needs CUDA devices {first}..{first + world - 1}, "
            f"but {visible} {'is' if visible == 1 else 'are'} visible", "tensor_parallel_size")


def split_points(total: int, parts: int, align: int = 1) -> tuple[int, ...]:
    """``parts + 1`` ascending boundaries from 0 to ``total``, as even as ``align`` allows
    (inner boundaries are multiples of ``align``).

    Raises:
        InvalidRequestError: a piece would be empty.
    """
    points = [0] + [min(total, round(i * total / parts / align) * align) for i in range(1, parts)] + [total]
    if any(b <= a for a, b in zip(points, points[1:])):
        raise InvalidRequestError(f"cannot split {total} into {parts} pieces of multiples of {align}",
                                  "tensor_parallel_size")
    return tuple(points)


@dataclass(slots=True, frozen=True)
class TensorParallelPlan:
    """The pieces of one model and the run of pieces each of ``world`` ranks owns.

    Attributes:
        world: N, the number of ranks (tensor-parallel size).
        pieces: S, the number of pieces (the model's KV heads).
        heads_per_piece: query heads of one piece (the GQA group size H/S).
        head_dim: hd.
        ffn: ``S + 1`` FFN column boundaries (multiples of :data:`ALIGN`).
        vocab: ``S + 1`` vocabulary row boundaries.
        owner: ``N + 1`` piece boundaries: rank r owns pieces ``owner[r]:owner[r+1]``.
    """

    world: int
    pieces: int
    heads_per_piece: int
    head_dim: int
    ffn: tuple[int, ...]
    vocab: tuple[int, ...]
    owner: tuple[int, ...]

    @classmethod
    def build(cls, args: ModelArgs, world: int) -> "TensorParallelPlan":
        """The plan for ``args`` over ``world`` ranks.

        Raises:
            InvalidRequestError: ``world`` < 1, or more ranks than KV heads (every rank needs
                at least one whole KV head; vLLM would replicate KV heads instead, and it also
                refuses query-head counts that ``world`` does not divide, which this plan allows
                by giving ranks whole GQA groups, some one more than others).
        """
        if world < 1:
            raise InvalidRequestError(f"--tensor-parallel-size must be >= 1, got {world}", "tensor_parallel_size")
        kv = args.num_key_value_heads
        if world > kv:
            raise InvalidRequestError(
                f"--tensor-parallel-size {world}: the model has {kv} KV head{'s' * (kv != 1)}, and each rank needs "
                f"at least one (use at most {kv}; vLLM replicates KV heads in this case, monobatch does not)",
                "tensor_parallel_size")
        return cls(world=world, pieces=kv, heads_per_piece=args.num_attention_heads // kv, head_dim=args.head_dim,
                   ffn=split_points(args.intermediate_size, kv, ALIGN), vocab=split_points(args.vocab_size, kv),
                   owner=split_points(kv, world))

    def local_pieces(self, rank: int) -> range:
        """The pieces rank ``rank`` owns."""
        return range(self.owner[rank], self.owner[rank + 1])

    def max_local_pieces(self) -> int:
        """The most pieces any rank owns (rank 0's)."""
        return self.owner[1] - self.owner[0]

    def kv_heads(self, rank: int) -> int:
        """KV heads rank ``rank`` holds (one per piece)."""
        return len(self.local_pieces(rank))

    def vocab_range(self, rank: int) -> tuple[int, int]:
        """The vocabulary rows ``[lo, hi)`` of rank ``rank``."""
        r = self.local_pieces(rank)
        return self.vocab[r.start], self.vocab[r.stop]

    def describe(self) -> str:
        """``tensor parallel 2 ranks (KV heads 2+1 of 3)``: for the start-up line."""
        split = "+".join(str(self.kv_heads(r)) for r in range(self.world))
        return f"tensor parallel {self.world} rank{'s' * (self.world != 1)} (KV heads {split} of {self.pieces})"
