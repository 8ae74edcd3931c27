"""Sharded layers and :func:`shard_model`: one rank's part of a model, dense or packed weights alike.

Megatron's split of a block (Shoeybi et al. 2019, section 3):

- **column-parallel** (``qkv_proj``, ``gate_up_proj``, the LM head): a rank holds some *output
  rows* of the weight and computes those outputs; nothing is exchanged. The fused ``qkv_proj`` =
  cat(q, k, v) rows and ``gate_up_proj`` = cat(gate, up) rows are sharded piece by piece, so a
  rank's weight is cat(q_r, k_r, v_r) (resp. cat(gate_r, up_r)) and the family code's split of
  the output by its (local) sizes is unchanged.
- **row-parallel** (``o_proj``, ``down_proj``): a rank holds some *input columns* (K) — the
  columns of its own heads / FFN columns, which are exactly the activations it computed — and its
  product is a partial sum; one all-reduce adds the ranks' partials.
- **vocabulary-parallel** embedding and LM head: a rank holds some vocabulary rows; a lookup
  zeroes the ids it does not own and an all-reduce adds the ranks' rows (exactly one rank
  contributes each, so the sum is exact); the head's logits are gathered on the driver.

Packed weights (:class:`~monobatch.quant.packed.PackedWeight`) shard the same way: output rows
are whole packed rows; a K split must fall on the layout's group (16/32 columns), which the plan's
boundaries do (:mod:`monobatch.distributed.plan`); a weight whose split does not is dequantized
(logged once).

Deterministic mode (``pieces=True``): every sharded layer keeps its plan pieces apart and runs one
product per piece — the same products, on the same weights, that TP=1 runs in that mode — and a
row-parallel layer sums all S pieces' partials in piece order on every rank (an all-gather, then
``((p0 + p1) + p2) + ...``), so TP=N computes TP=1's bits (ADR 0007). Column-parallel layers of
packed CPU weights are the exception that shares one call: that kernel computes each output row
alone (:func:`row_independent`).

Exact zeros: the vocabulary all-reduce turns a -0.0 embedding entry into +0.0, which no later
product or sum can tell apart.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from monobatch.distributed.comm import TpGroup
from monobatch.distributed.plan import TensorParallelPlan
from monobatch.models.layers import (Attention, CpuRoute, DecoderModel, GatedMLP, Linear, combined_mat, hold_packed,
                                     matmul, packed_mat, row_independent)
from monobatch.quant.packed import PackedPart, PackedWeight

log = logging.getLogger(__name__)

Weight = torch.Tensor | PackedWeight


# -- slicing weights ------------------------------------------------------------------------------

def take_rows(w: Weight, ranges: list[tuple[int, int]], copy_: bool) -> Weight:
    """The output rows ``ranges`` (``[lo, hi)`` each, in order) of ``w`` ``[N, K]`` stacked:
    ``[sum(hi - lo), K]``. One range of a dense or single-layout weight is a view unless
    ``copy_`` (a worker's shard must not hold the whole weight's storage)."""
    if isinstance(w, torch.Tensor):
        parts = [w[lo:hi] for lo, hi in ranges]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.clone() if copy_ and len(parts) == 1 else out
    pieces: list[PackedPart] = []
    for lo, hi in ranges:
        start = 0
        for part in w.parts:  # a range may span parts (a fused projection's pieces of different types)
            a, b = max(lo, start), min(hi, start + part.rows)
            if a < b:
                s = slice(a - start, b - start)
                pieces.append(part.select(s))
            start += part.rows
    merged: list[PackedPart] = []
    for p in pieces:  # neighbours of one layout become one part (one kernel call)
        if merged and merged[-1].layout == p.layout:
            merged[-1] = _map_fields(lambda a, b: torch.cat([a, b]), merged[-1], p)
        else:
            merged.append(p)
    if copy_:
        merged = [_map_fields(torch.clone, p) for p in merged]
    return PackedWeight(merged, w.k, w.types)


def _map_fields(fn, *parts: PackedPart) -> PackedPart:
    """A part of the first's layout whose every tensor field is ``fn`` of the parts' (None stays None)."""
    return PackedPart(parts[0].layout, *(None if getattr(parts[0], f) is None else fn(*(getattr(p, f) for p in parts))
                                         for f in ("qs", "scale", "minimum", "sup")))


def packed_cols_ok(w: PackedWeight, lo: int, hi: int) -> bool:
    """Whether input columns ``[lo, hi)`` of packed ``w`` fall on every part's group boundaries."""
    return all(_cut_on(lo, hi, w.k, p.layout.group) for p in w.parts)


def _cut_on(lo: int, hi: int, k: int, unit: int) -> bool:
    return lo % unit == 0 and (hi % unit == 0 or hi == k)


def take_cols(w: Weight, lo: int, hi: int) -> Weight:
    """Input columns ``[lo, hi)`` of ``w`` ``[N, K]``: ``[N, hi - lo]``, contiguous (a copy).
    A packed weight must be cut on its groups (:func:`packed_cols_ok`); a part with factored scales
    cut inside a 256-column super-block is sliced in its DIRECT layout (``PackedPart.direct``)."""
    if isinstance(w, torch.Tensor):
        return w[:, lo:hi].contiguous()
    parts = []
    for p in w.parts:
        if not _cut_on(lo, hi, w.k, p.layout.super_block):
            p = p.direct()
        g = p.layout.group
        q = p.qs[:, lo // 2:hi // 2] if p.layout.q4 else p.qs[:, lo:hi]  # q4: 16 bytes per 32-column group
        groups = lambda t: None if t is None else t[:, lo // g:-(-hi // g)].contiguous()  # noqa: E731
        sup = None if p.sup is None else p.sup[:, lo // 256:-(-hi // 256)].contiguous()
        parts.append(PackedPart(p.layout, q.contiguous(), groups(p.scale), groups(p.minimum), sup))
    return PackedWeight(parts, hi - lo, w.types)


def _linear(weight: Weight, bias: torch.Tensor | None) -> Linear:
    """A :class:`Linear` holding ``weight`` ``[N, K]`` (dense or packed) and ``bias`` ``[N]``."""
    n, k = weight.shape
    lin = Linear(k, n, bias=bias is not None)
    if isinstance(weight, PackedWeight):
        hold_packed(lin, "weight", weight)
    else:
        lin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


# -- the parallel layers --------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """A rank's output rows of a linear layer: x ``[T, in]`` -> ``[T, out_local]``, no collective.

    Args:
        pieces: Linears whose outputs, concatenated in order, are this rank's outputs (one in
            the fast mode; one per plan piece and fused sub-projection in deterministic mode).
    """

    def __init__(self, pieces: list[Linear]) -> None:
        super().__init__()
        self.pieces = nn.ModuleList(pieces)

    @property
    def packed(self) -> bool:
        """Whether the weights are held packed."""
        return self.pieces[0].packed

    def fused_mat(self):
        """The fused CPU ops' handle of this layer (:func:`monobatch.models.layers.packed_mat`):
        its pieces' products concatenated, or None where a piece has none."""
        return combined_mat([packed_mat(p) for p in self.pieces])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, in]`` -> ``[T, out_local]``."""
        if len(self.pieces) == 1:
            return self.pieces[0](x)
        return torch.cat([p(x) for p in self.pieces], dim=-1)


class RowParallelLinear(nn.Module):
    """A rank's input columns of a linear layer; the ranks' partial products are summed.

    Args:
        pieces: Linears over consecutive column ranges of this rank's input ``[T, in_local]``
            (one in the fast mode: one all-reduce; one per local plan piece in deterministic
            mode: all S pieces' partials gathered and summed in piece order).
        bias: ``[out]``, added once after the sum (None: none).
        total_pieces: S (deterministic mode: the partials gathered from every rank).
        max_local: the most pieces a rank holds (the all-gather's padding).
    """

    def __init__(self, pieces: list[Linear], bias: torch.Tensor | None, total_pieces: int, max_local: int) -> None:
        super().__init__()
        self.pieces = nn.ModuleList(pieces)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.widths = [p.weight.shape[1] for p in pieces]
        self.total_pieces, self.max_local = total_pieces, max_local
        self.group: TpGroup | None = None
        self.deterministic = False
        self.counts: tuple[int, ...] = (len(pieces),)  # pieces per rank (set by shard_model)

    @property
    def packed(self) -> bool:
        """Whether the weights are held packed."""
        return self.pieces[0].packed

    def fused_mat(self):
        """The fused CPU ops' handle of this layer (:func:`monobatch.models.layers.packed_mat`)
        where it computes everything in this process (no other rank, no bias): in deterministic
        mode its pieces' products summed in piece order (``PackedMat.pieces``), the bits of
        :meth:`forward`; else its one piece's. None otherwise."""
        if self.bias is not None or (self.group is not None and self.group.world > 1):
            return None
        if not self.deterministic:
            return packed_mat(self.pieces[0]) if len(self.pieces) == 1 else None
        return combined_mat([packed_mat(p) for p in self.pieces], self.widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, in_local]`` (this rank's heads' / FFN columns' activations) -> ``[T, out]``, the
        full product, identical on every rank."""
        if not self.deterministic:
            y = self.pieces[0](x)  # (T, out) partial sum over this rank's columns
            if self.group is not None:
                self.group.all_reduce(y)
            return y if self.bias is None else y + self.bias
        parts, lo = [], 0
        for p, w in zip(self.pieces, self.widths):
            parts.append(p(x[:, lo:lo + w].contiguous()))  # (T, out) per piece
            lo += w
        T, out = x.shape[0], parts[0].shape[1]
        if self.group is not None and self.group.world > 1:
            pad = [torch.zeros(T, out, dtype=parts[0].dtype, device=x.device)] * (self.max_local - len(parts))
            every = self.group.all_gather(torch.stack(parts + pad))  # world x (max_local, T, out)
            parts = [t for rank, g in enumerate(every) for t in g[:self.counts[rank]]]  # S partials, piece order
        y = parts[0]
        for p in parts[1:]:  # the fixed order: ((p0 + p1) + p2) + ...
            y = y + p
        return y if self.bias is None else y + self.bias


class VocabParallel(nn.Module):
    """A rank's vocabulary rows ``[lo, hi)`` of the embedding and the LM head.

    Args:
        embed: the rows ``[hi - lo, D]`` (dense or packed).
        head: Linears of the LM head's rows, in order (the embedding's rows again when tied).
        lo, hi: this rank's rows.
        width: the most rows a rank holds (the logits' gather is padded to it).
        full: V, the full vocabulary.
        ranges: every rank's ``(lo, hi)`` (the driver cuts the gathered logits by them).
    """

    def __init__(self, embed: Weight, head: list[Linear], lo: int, hi: int, width: int, full: int,
                 ranges: list[tuple[int, int]]) -> None:
        super().__init__()
        self.embed_weight = nn.Parameter(embed, requires_grad=False) if isinstance(embed, torch.Tensor) else embed
        self.head = nn.ModuleList(head)
        self.lo, self.hi, self.width, self.full, self.ranges = lo, hi, width, full, ranges
        self.group: TpGroup | None = None

    def embed(self, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """token_ids int64 ``[T]`` -> ``[T, D]`` rows in ``dtype``: this rank's rows, zeros elsewhere,
        summed over the ranks."""
        mine = (token_ids >= self.lo) & (token_ids < self.hi)
        local = torch.where(mine, token_ids - self.lo, torch.zeros_like(token_ids))
        w = self.embed_weight
        rows = w.embedding(local, dtype) if isinstance(w, PackedWeight) else torch.nn.functional.embedding(local, w)
        rows = rows * mine[:, None].to(rows.dtype)
        if self.group is not None and self.group.world > 1:
            self.group.all_reduce(rows)
        return rows

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[R, D]`` (normed) -> float32 ``[R, V]`` logits on the driver (this rank's ``[R, hi - lo]``
        on the others)."""
        parts = [matmul(x, p.weight, p.bias, out_dtype=torch.float32) for p in self.head]
        local = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # (R, hi - lo)
        if self.group is None or self.group.world == 1:
            return local
        R = local.shape[0]
        padded = torch.zeros(R, self.width, dtype=local.dtype, device=local.device)
        padded[:, :local.shape[1]] = local
        every = self.group.gather(padded)
        if every is None:
            return local
        return torch.cat([t[:, :hi - lo] for t, (lo, hi) in zip(every, self.ranges)], dim=-1)  # (R, V)


# -- sharding a model -----------------------------------------------------------------------------

def _shared_memo(model: nn.Module) -> dict[int, object]:
    """A deepcopy memo that keeps every tensor and packed weight shared (the copy is cheap; the
    sharded modules are then replaced by new ones holding the slices)."""
    memo: dict[int, object] = {}
    for m in model.modules():
        for v in list(m._parameters.values()) + list(m._buffers.values()) + list(vars(m).values()):
            if isinstance(v, (torch.Tensor, PackedWeight)):
                memo[id(v)] = v
    return memo


def _dense_if_uncut(w: Weight, cuts: list[int], name: str) -> Weight:
    """``w`` itself, or its dequantized float32 copy when a K cut misses a packed group (logged)."""
    if isinstance(w, PackedWeight) and not all(packed_cols_ok(w, a, b) for a, b in zip(cuts, cuts[1:])):
        log.warning("tensor parallel: %s's K split %s misses its quantization groups; dequantized", name, cuts)
        return w.dequantize()
    return w


def shard_model(model: DecoderModel, plan: TensorParallelPlan, rank: int, pieces: bool, copy_: bool) -> DecoderModel:
    """Rank ``rank``'s shard of ``model`` (a new module tree; ``model`` is not changed).

    Args:
        model: a loaded model (any family built from :mod:`monobatch.models.layers`).
        plan: the pieces and their owners.
        rank: which rank's shard.
        pieces: deterministic mode: keep the plan's pieces apart (one product each, row-parallel
            partials summed in piece order); else one product per layer and rank.
        copy_: copy the slices (a worker's shard, shipped to another process); else views where
            possible (TP=1 in deterministic mode).

    Returns:
        The shard; attach the process group with :func:`attach` before running it.
    """
    memo = _shared_memo(model)
    shard = copy.deepcopy(model, memo)
    mine = plan.local_pieces(rank)
    hd, g = plan.head_dim, plan.heads_per_piece
    counts = tuple(plan.kv_heads(r) for r in range(plan.world))
    for name, module in shard.named_modules():
        if isinstance(module, Attention):
            q_size, kv_size = module.q_size, module.kv_size
            qr = [(p * g * hd, (p + 1) * g * hd) for p in mine]
            kr = [(q_size + p * hd, q_size + (p + 1) * hd) for p in mine]
            vr = [(q_size + kv_size + p * hd, q_size + kv_size + (p + 1) * hd) for p in mine]
            module.qkv_proj = _column(module.qkv_proj, [qr, kr, vr], pieces, copy_)
            module.o_proj = _row(module.o_proj, [(p * g * hd, (p + 1) * g * hd) for p in mine], pieces, plan, counts,
                                 f"{name}.o_proj")
            module.n_heads, module.n_kv = len(mine) * g, len(mine)
            module.q_size, module.kv_size = module.n_heads * hd, module.n_kv * hd
        elif isinstance(module, GatedMLP):
            F = module.ffn
            fr = [(plan.ffn[p], plan.ffn[p + 1]) for p in mine]
            module.gate_up_proj = _column(module.gate_up_proj, [fr, [(F + a, F + b) for a, b in fr]], pieces, copy_)
            module.down_proj = _row(module.down_proj, fr, pieces, plan, counts, f"{name}.down_proj")
            module.ffn = sum(b - a for a, b in fr)
    lo, hi = plan.vocab_range(rank)
    vr = [(plan.vocab[p], plan.vocab[p + 1]) for p in mine]
    embed = take_rows(model.embed_tokens, [(lo, hi)], copy_)
    if model.lm_head is None:  # tied: the head's pieces are the embedding's rows
        head = [_linear(take_rows(embed, [(a - lo, b - lo)], False), None)
                for a, b in (vr if pieces and not row_independent(embed) else [(lo, hi)])]
    else:
        w, b = model.lm_head.weight, model.lm_head.bias
        head = [_linear(take_rows(w, [r], copy_), None if b is None else b[r[0]:r[1]].clone())
                for r in (vr if pieces and not row_independent(w) else [(lo, hi)])]
        shard.lm_head = None  # the head is the VocabParallel's
    ranges = [plan.vocab_range(r) for r in range(plan.world)]
    shard.embed_tokens = None
    shard.vocab_parallel = VocabParallel(embed, head, lo, hi, max(b - a for a, b in ranges), model.args.vocab_size,
                                         ranges)
    for m in shard.modules():
        if isinstance(m, RowParallelLinear):
            m.deterministic = pieces
    return shard


def _column(lin: Linear, groups: list[list[tuple[int, int]]], pieces: bool, copy_: bool) -> ColumnParallelLinear:
    """A column-parallel layer of ``lin``'s rows: ``groups`` are the fused sub-projections' row
    ranges (q, k, v or gate, up), each a list of plan pieces; outputs ordered group by group."""
    w, b = lin.weight, lin.bias
    def make(ranges: list[tuple[int, int]]) -> Linear:
        return _linear(take_rows(w, ranges, copy_), None if b is None else torch.cat([b[lo:hi] for lo, hi in ranges]))
    if pieces and not row_independent(w):
        return ColumnParallelLinear([make([r]) for grp in groups for r in grp])
    return ColumnParallelLinear([make([r for grp in groups for r in grp])])


def _row(lin: Linear, cols: list[tuple[int, int]], pieces: bool, plan: TensorParallelPlan,
         counts: tuple[int, ...], name: str) -> RowParallelLinear:
    """A row-parallel layer of ``lin``'s input columns ``cols`` (plan pieces, consecutive)."""
    w = _dense_if_uncut(lin.weight, sorted({c for r in cols for c in r}), name)
    spans = cols if pieces else [(cols[0][0], cols[-1][1])]
    layer = RowParallelLinear([_linear(take_cols(w, lo, hi), None) for lo, hi in spans], lin.bias,
                              plan.pieces, plan.max_local_pieces())
    layer.counts = counts
    return layer


def attach(model: nn.Module, group: TpGroup | None) -> None:
    """Give every parallel layer of a shard this process's group (None: no collectives), and forget
    every fused CPU route decided before (``RowParallelLinear.fused_mat`` reads the group: a route
    decided without it would skip the all-reduce)."""
    for m in model.modules():
        if isinstance(m, (RowParallelLinear, VocabParallel)):
            m.group = group
        if isinstance(getattr(m, "cpu_route", None), CpuRoute):
            m.cpu_route.call = None
