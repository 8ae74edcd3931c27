"""Varlen paged attention: every query row of a step — prefill chunks of many sequences, cache
hits' recomputed tails, decode tokens mixed in — in one launch per layer, reading keys and values
straight from the paged pool through each sequence's block table.

Before it, a step with prompt chunks ran one masked SDPA per chunk per layer (and built each
chunk's causal mask on the device): 128 prompts of a llama-1b step were 2,048 launches a layer
stack and their Python, the reason batched prefill got slower as the batch grew. This is the
varlen layout of FlashAttention-2 (Dao 2023, ``cu_seqlens``) over a paged cache (vLLM's
``chunked_prefill_paged_decode`` / FlashInfer's ``BatchPrefillWithPagedKVCache`` do the same).

Work split: the step's chunks are cut into *tiles* of ``BT`` consecutive query tokens; one program
per (tile, KV head) computes the ``BT x G`` query rows of that tile and KV head (GQA: the G query
heads sharing a KV head are rows of one ``tl.dot``, so each key is read once for all of them),
running an online softmax (Milakov & Gimelshein 2018) over the sequence's keys in blocks of
``BLOCK_N`` from position 0 (or from the sliding window's start) up to the tile's last position,
causal per row. Tiles are host metadata (:class:`VarlenMeta`), so a step of any mix of chunk
lengths is one launch. In deterministic mode a grid axis of split programs is added (rule 3
below): a B=1 decode step is no longer n_kv programs per layer, each walking every key.

Batch invariance (``--deterministic``): a row's result depends only on its own query, its keys,
its position and the kernel's tile shape, never on the step it is computed in — a decode row
alone or in any batch, a prefill row at any offset of a chunk of any length, on dense or paged
storage, on a prefix-cache hit's recomputed tail. Three rules give that:

1. *Key blocks at absolute positions.* Keys are read in blocks of ``BLOCK_N`` aligned to multiples
   of ``BLOCK_N`` from position 0, and a block wholly past a row's position (or before its window)
   leaves that row's running state unchanged (the ``m_safe`` guard keeps such a block from
   producing NaN or rescaling; the state's bits are unchanged but for the sign of an exact zero,
   which no later value can see). One tile shape (:data:`DETERMINISTIC_ROWS`) for every row, so
   each ``tl.dot`` has one shape.
2. *A fixed KV split per row* (issue 16). The keys of a row at position ``p`` are cut at the
   absolute positions ``j * S`` (:func:`split_size`: ``S = max(SPLIT_MIN, next_pow2(span) //
   SPLIT_PARTS)`` with ``span = min(p + 1, window)``, a power-of-two multiple of ``BLOCK_N``, a
   function of ``p`` and the layer alone; at most ``SPLIT_PARTS + 2`` splits). Each split runs its
   own online softmax from ``(m, l, acc) = (-inf, 0, 0)`` with the per-block code
   (:func:`_attend_block`), and the splits are merged in ascending order from ``(-inf, 0, 0)`` by
   one formula (:func:`_merge`: ``M' = max(M, m)``, ``L' = fma(L, 2^(M-M'), l 2^(m-M'))``, the
   same for the accumulator; a split without a key for the row is skipped), then ``out = ACC / L``.
3. *Two schedules, one arithmetic.* A tile whose rows all have one split size (every decode
   row; a prompt tile unless it straddles a power of two of ``span``) may run its splits in
   separate programs (the grid's third axis, :func:`grid_splits`: steps of few tiles, i.e. decode
   steps and short chunks, so that a B=1 decode at 8K keys has ~32 programs per KV head instead
   of one): each stores its splits' fp32 partials ``(m, l, acc)`` and the last program of the
   tile to finish (an int32 counter, :func:`monobatch.kernels.common.counters`) merges them in
   split order (token by token, on ``[G_PAD, HD]`` tiles: the merge is elementwise, so its
   layout does not change a bit). Every other tile (and every tile when the grid has one program
   per tile) runs its splits one after another in one program, merging in registers at each
   row's split boundaries. Both schedules call the same ``_attend_block`` on the same ``(R, HD) x
   (HD, BN)`` shapes and the same ``_merge``, whose multiply-adds are explicit ``fma`` (ptxas
   contracts a plain multiply and add where it finds them, a choice left to it nowhere here), so
   a row gets the same bits from either; which one runs may follow the step.
   ``tests/test_varlen_split_ptx.py`` checks the compiled code for that (one MMA signature per
   dot for both schedules, no contractible multiply-add in the PTX).

The default mode has no split (one online softmax over all of a row's keys, the ``SPLIT=False``
variant, unchanged) and picks its tile for speed (:data:`FAST_ROWS`); its decode steps run
:mod:`monobatch.kernels.paged_decode`'s split-K kernel instead.

Softmax scale: ``scale`` (1/sqrt(head_dim) when omitted, as
:func:`monobatch.kv.attention.attend_chunk`). The reference for tests is ``attend_chunk`` on each
chunk's gathered keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from monobatch import env
from monobatch.kernels import pdl
from monobatch.kernels.common import counters, require_triton, sm_count, tl, triton

#: Keys one loop iteration loads (a multiple of 16 for tl.dot); key blocks start at multiples of it.
#: ``MONOBATCH_VARLEN_BLOCK_N`` overrides it (A/B runs; a deterministic process's bits follow it).
BLOCK_N = env.fatal_integer("MONOBATCH_VARLEN_BLOCK_N", 64, minimum=16, power_of_two=True)
#: Query rows (tokens x padded query heads of one KV head) of one program in the default mode.
FAST_ROWS = 128
#: The one tile shape of deterministic mode, for decode and prefill rows alike (see the module
#: docstring): a row's bits depend on the tile shape, so it never changes with the batch.
DETERMINISTIC_ROWS = 64
#: Software-pipeline depth of the key loop. ``MONOBATCH_VARLEN_STAGES`` overrides it (A/B runs).
KV_STAGES = env.fatal_integer("MONOBATCH_VARLEN_STAGES", 2)
#: Warps of one program. ``MONOBATCH_VARLEN_WARPS`` overrides it (A/B runs; a deterministic
#: process's bits may follow it, as they follow the tile shape).
NUM_WARPS = env.fatal_integer("MONOBATCH_VARLEN_WARPS", 4, maximum=32, power_of_two=True)


def _split_setting(text: str) -> tuple[int, int, int]:
    try:
        values = [int(v) for v in text.split(",")]
        if len(values) == 2:
            values.append(2)
        smallest, parts, waves = values
        if smallest >= BLOCK_N and smallest & (smallest - 1) == 0 and parts >= 1 and parts & (parts - 1) == 0 \
                and waves >= 1:
            return smallest, parts, waves
        if 0 < smallest < BLOCK_N and smallest & (smallest - 1) == 0:  # a split is whole key blocks
            raise env.SettingError(f"MONOBATCH_VARLEN_BLOCK_N={BLOCK_N} (keys an iteration) is above the deterministic "
                             f"split's SPLIT_MIN {smallest} (MONOBATCH_DET_SPLIT={text!r}): set SPLIT_MIN >= {BLOCK_N}")
    except ValueError:
        pass
    raise env.SettingError(f"MONOBATCH_DET_SPLIT={text!r}: expected 'SPLIT_MIN,SPLIT_PARTS[,WAVES]': SPLIT_MIN a power "
                     f"of two >= {BLOCK_N}, SPLIT_PARTS a power of two, WAVES a positive integer")


#: Deterministic mode's fixed KV split (module docstring, rule 2): a row's keys are cut every
#: :func:`split_size` keys, at least ``SPLIT_MIN``, about ``SPLIT_PARTS`` splits for a long row;
#: the split grid aims at ``SPLIT_WAVES`` programs per SM (:func:`grid_splits`).
#: ``MONOBATCH_DET_SPLIT=128,32[,2]`` overrides them (A/B runs; a process's bits follow them).
#: 128 keys, from an H200 A/B (llama-1b shape, docs/benchmarks/README.md, 2026-12-02): a
#: smaller split folds after every key block on the loop schedule, which costs batched decode
#: (B=64 total 33.8k tok/s at 64 keys, 41.5k at 128, 51.6k at 256); a larger one leaves a
#: short-context B=1 decode fewer programs (p256: 905 / 891 / 857 tok/s).
SPLIT_MIN, SPLIT_PARTS, SPLIT_WAVES = _split_setting(env.text("MONOBATCH_DET_SPLIT") or "128,32")
#: Most splits of one tile (a sliding window's keys may start mid-split: ``SPLIT_PARTS + 2``).
MAX_SPLITS = SPLIT_PARTS + 2
#: Steps of more query rows than this never use the split grid (they have tiles enough, and the
#: partials' workspace grows with the rows).
SPLIT_MAX_TOKENS = 64


def split_size(pos: int, window: int = 0) -> int:
    """Keys per split of a deterministic row at position ``pos`` of a layer with sliding window
    ``window`` (0: none): ``max(SPLIT_MIN, next_pow2(min(pos + 1, window)) // SPLIT_PARTS)``. The
    kernel's ``_split_size``, for tests and docs."""
    span = pos + 1 if window <= 0 else min(pos + 1, window)
    return max(SPLIT_MIN, (1 << (span - 1).bit_length()) // SPLIT_PARTS)


def grid_splits(num_tiles: int, num_kv_heads: int, num_rows: int, device: torch.device) -> int:
    """Programs per (tile, KV head) of a deterministic launch (the grid's third axis): enough
    to fill the GPU :data:`SPLIT_WAVES` times over, at most :data:`MAX_SPLITS`; 1 (every tile in
    one program) for a step of more than :data:`SPLIT_MAX_TOKENS` rows. A function of the step's
    shape only (a captured graph keeps it); a row's bits do not depend on it."""
    if num_rows > SPLIT_MAX_TOKENS or num_tiles == 0:
        return 1
    want = -(-SPLIT_WAVES * sm_count(device) // (num_tiles * num_kv_heads))
    return max(1, min(want, MAX_SPLITS))


@dataclass(slots=True)
class VarlenMeta:
    """A step's chunk and tile layout for :func:`varlen_paged_attention` (device tensors).

    Attributes:
        block_tables: ``[N, nb]`` int32 block ids of each chunk's sequence, in position order.
        q_start: ``[N]`` int32 flat row of each chunk's first token in the step's ``[T, ...]``.
        q_len: ``[N]`` int32 tokens of each chunk.
        pos: ``[N]`` int32 position of each chunk's first token (its cached length before the step).
        tile_chunk: ``[NT]`` int32 chunk of each tile.
        tile_off: ``[NT]`` int32 first token of each tile within its chunk.
        tokens_per_tile: ``BT``, query tokens of one tile.
        fixed_split: deterministic mode's fixed KV split (the module docstring's rule 2); set
            with the deterministic tile (:func:`tokens_per_tile`).
    """

    block_tables: torch.Tensor
    q_start: torch.Tensor
    q_len: torch.Tensor
    pos: torch.Tensor
    tile_chunk: torch.Tensor
    tile_off: torch.Tensor
    tokens_per_tile: int
    fixed_split: bool = False

    @property
    def num_tiles(self) -> int:
        """NT, programs per KV head."""
        return int(self.tile_chunk.shape[0])


def tokens_per_tile(num_q_heads: int, num_kv_heads: int, deterministic: bool) -> int:
    """``BT``: query tokens per tile so that ``BT * G_PAD`` rows fill one program's tile
    (:data:`DETERMINISTIC_ROWS` or :data:`FAST_ROWS`); at least 1."""
    g_pad = 1 << max(0, (num_q_heads // num_kv_heads) - 1).bit_length()
    return max(1, (DETERMINISTIC_ROWS if deterministic else FAST_ROWS) // g_pad)


def tile_layout(chunks: Sequence[tuple[int, int, int]], bt: int) -> list[tuple[int, int]]:
    """``(chunk, first token in the chunk)`` of every tile of ``bt`` tokens, ordered by descending
    last position (the longest programs first, so the short ones fill the tail of the launch).
    ``chunks``: ``(q_start, q_len, pos)`` each."""
    tiles = [(pos + min(off + bt, length), i, off) for i, (_, length, pos) in enumerate(chunks)
             for off in range(0, length, bt)]
    tiles.sort(key=lambda t: -t[0])
    return [(i, off) for _, i, off in tiles]


#: int32 elements per 16 bytes: where :func:`build_meta` starts each part of its buffer.
_ALIGN = 4


def build_meta(chunks: Sequence[tuple[int, int, int]], tables: Sequence[Sequence[int]], bt: int,
               device: torch.device, fixed_split: bool = False) -> VarlenMeta:
    """Lay out a step's chunks as tiles (host work, one copy to ``device``).

    Args:
        chunks: ``(q_start, q_len, pos)`` per chunk, in batch order.
        tables: each chunk's block ids (at least ``ceil((pos + q_len) / block_size)`` of them).
        bt: query tokens per tile (:func:`tokens_per_tile`).
        fixed_split: deterministic mode's KV split (:class:`VarlenMeta`).

    Returns:
        The metadata, tiles ordered by descending last position (the longest programs first, so
        the short ones fill the tail of the launch).
    """
    n = len(chunks)
    nb = max(1, max((len(t) for t in tables), default=1))
    tiles = tile_layout(chunks, bt)
    nt = len(tiles)
    # One int32 buffer (one copy), each part starting on a 16-byte boundary: Triton specialises a
    # kernel on each pointer's 16-byte alignment, so parts at offsets n, 2n, ... would make the
    # chunk and tile counts mod 4 pick among a dozen compiles of the kernel -- JIT compiles in a
    # server's first requests (issue 16's TTFT tail: two such compiles in a bench-serve round
    # after start-up, on the H200).
    sizes = (n, n, n, nt, nt, n * nb)  # q_start, q_len, pos, tile_chunk, tile_off, block tables
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + -(-size // _ALIGN) * _ALIGN)
    flat = torch.zeros(starts[-1] + sizes[-1], dtype=torch.int32)
    for k in range(3):
        flat[starts[k]:starts[k] + n] = torch.tensor([c[k] for c in chunks], dtype=torch.int32)
    if tiles:
        flat[starts[3]:starts[3] + nt] = torch.tensor([c for c, _ in tiles], dtype=torch.int32)
        flat[starts[4]:starts[4] + nt] = torch.tensor([o for _, o in tiles], dtype=torch.int32)
    table_part = flat[starts[5]:].view(n, nb)
    for i, t in enumerate(tables):
        if t:
            table_part[i, :len(t)] = torch.as_tensor(t, dtype=torch.int32)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    part = [flat[a:a + size] for a, size in zip(starts, sizes)]
    return VarlenMeta(block_tables=part[5].view(n, nb), q_start=part[0], q_len=part[1], pos=part[2],
                      tile_chunk=part[3], tile_off=part[4], tokens_per_tile=bt, fixed_split=fixed_split)


if triton is not None:

    @triton.jit
    def _split_size(pos, window, SPLIT_MIN: tl.constexpr, SHIFT: tl.constexpr):
        """:func:`split_size` of position ``pos`` (a scalar or a tensor of int32 positions)."""
        span = tl.minimum(pos + 1, tl.where(window > 0, window, 1 << 30))
        x = span - 1  # next power of two of span: smear the highest bit of span - 1 down, add 1
        x = x | (x >> 1)
        x = x | (x >> 2)
        x = x | (x >> 4)
        x = x | (x >> 8)
        x = x | (x >> 16)
        return tl.maximum((x + 1) >> SHIFT, SPLIT_MIN)

    @triton.jit
    def _tile_rows(Q, q_start, q_len, pos0, off, kvh, stride_qt, stride_qh, offs_d, G: tl.constexpr,
                   G_PAD: tl.constexpr, R: tl.constexpr):
        """A tile's ``R = BT x G_PAD`` query rows (token-major: the G heads of KV head ``kvh`` of
        each token, padded to G_PAD): ``(q, rmask, qpos, row, heads)`` — the queries, which rows
        are real, each row's position, its token's row in the step, its query head."""
        offs_r = tl.arange(0, R)
        tok = off + offs_r // G_PAD  # token of each row within the chunk
        head = offs_r % G_PAD
        rmask = (tok < q_len) & (head < G)
        row = (q_start + tok).to(tl.int64)
        heads = kvh * G + head
        q = tl.load(Q + row[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=rmask[:, None], other=0.0)
        return q, rmask, pos0 + tok, row, heads

    @triton.jit
    def _attend_block(n, q, m, l_sum, acc, K, V, TABLES, c, stride_tb, stride_ks, kvh, stride_kh, offs_d, qpos,
                      first, hi, window, scale_log2, BS: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
                      EXACT: tl.constexpr):
        """One key block ``n .. n + BN - 1`` of the online softmax of a tile's rows: the running
        ``(m, l_sum, acc)`` after it. The one copy of the per-block arithmetic, for every
        schedule (module docstring). ``EXACT`` (deterministic mode): the one multiply-add as an
        explicit fma, so that ptxas (which contracts a plain multiply and add where it finds
        them) has no choice left that could differ between two schedules."""
        offs_n = n + tl.arange(0, BN)
        # keys before `first` are no row's: not loaded (paged storage may have released their
        # blocks, whose table entries then point at the scratch block; ADR 0005)
        nmask = (offs_n < hi) & (offs_n >= first)
        blk = tl.load(TABLES + c * stride_tb + offs_n // BS, mask=nmask, other=0).to(tl.int64)
        kv_off = (blk * BS + offs_n % BS)[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
        k = tl.load(K + kv_off, mask=nmask[:, None], other=0.0)  # (BN, HD)
        v = tl.load(V + kv_off, mask=nmask[:, None], other=0.0)
        if IEEE:  # float32 inputs: full-precision products, as the eager path (not TF32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # (R, BN) float32, log2 units
        else:
            s = tl.dot(q, tl.trans(k)) * scale_log2
        ok = nmask[None, :] & (offs_n[None, :] <= qpos[:, None])
        ok = ok & ((window <= 0) | (offs_n[None, :] > qpos[:, None] - window))
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # a row that has seen no key yet keeps (m, l, acc) = (-inf, 0, 0) exactly: no NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m - m_safe)
        if EXACT:
            l_sum = tl.fma(l_sum, alpha, tl.sum(p, 1))
        else:
            l_sum = l_sum * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_sum, acc

    @triton.jit
    def _merge(M, L, ACC, m, l_sum, acc, take):
        """Fold one split's ``(m, l_sum, acc)`` into the running ``(M, L, ACC)`` of the rows where
        ``take`` (the others keep theirs bit for bit). Explicit fma: the compiler has no
        contraction left to choose, so every schedule rounds alike."""
        top = tl.maximum(M, m)
        top = tl.where(top == float("-inf"), 0.0, top)  # rows with no key on either side: no NaN
        a = tl.math.exp2(M - top)
        b = tl.math.exp2(m - top)
        L_new = tl.fma(L, a, l_sum * b)
        ACC_new = tl.fma(ACC, a[:, None], acc * b[:, None])
        return (tl.where(take, tl.maximum(M, m), M), tl.where(take, L_new, L),
                tl.where(take[:, None], ACC_new, ACC))

    @triton.jit
    def _merge_partials(OUT, WS_ML, WS_ACC, q_start, t_lo, t_hi, kvh, nsplit, rows_q, stride_ot, stride_oh, offs_d,
                        NKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr,
                        MAX_SPLITS: tl.constexpr):
        """The split grid's merge, by a tile's last program: for each of its tokens ``t_lo ..
        t_hi - 1`` the G heads of KV head ``kvh``, their ``nsplit`` partials folded in split order
        from ``(-inf, 0, 0)`` by :func:`_merge`, divided, stored."""
        offs_g = tl.arange(0, G_PAD)
        gmask = offs_g < G
        for t in range(t_lo, t_hi):
            trow = (q_start + t).to(tl.int64)
            slot = trow * (NKV * G) + kvh * G + offs_g
            M = tl.full([G_PAD], float("-inf"), tl.float32)
            L = tl.zeros([G_PAD], tl.float32)
            ACC = tl.zeros([G_PAD, HD], tl.float32)
            for j in tl.static_range(MAX_SPLITS):  # unrolled: every split's loads in flight at once
                jmask = gmask & (j < nsplit)
                at = j * rows_q + slot
                m = tl.load(WS_ML + at, mask=jmask, other=float("-inf"), cache_modifier=".cg")
                l_sum = tl.load(WS_ML + MAX_SPLITS * rows_q + at, mask=jmask, other=0.0, cache_modifier=".cg")
                acc = tl.load(WS_ACC + at[:, None] * HD + offs_d[None, :], mask=jmask[:, None], other=0.0,
                              cache_modifier=".cg")
                M, L, ACC = _merge(M, L, ACC, m, l_sum, acc, l_sum > 0)
            out = ACC / tl.where(L > 0, L, 1.0)[:, None]
            tl.store(OUT + trow * stride_ot + (kvh * G + offs_g)[:, None] * stride_oh + offs_d[None, :],
                     out.to(OUT.dtype.element_ty), mask=gmask[:, None])

    # stride_tb, window and rows_q vary with the step (the widest table, the layer, the rows): not
    # specialized, so a row runs one binary whatever its batch (only address arithmetic would
    # differ, but one is simpler)
    @triton.jit(do_not_specialize=["stride_tb", "window", "rows_q"])
    def _varlen_kernel(Q, K, V, OUT, TABLES, Q_START, Q_LEN, POS, TILE_CHUNK, TILE_OFF, WS_ML, WS_ACC, CNT,
                       stride_qt, stride_qh, stride_ks, stride_kh, stride_tb, stride_ot, stride_oh, rows_q,
                       scale_log2, window, NKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                       HD: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
                       STAGES: tl.constexpr, SPLIT: tl.constexpr, SPLIT_MIN: tl.constexpr,
                       SPLIT_SHIFT: tl.constexpr, MAX_SPLITS: tl.constexpr, PDL: tl.constexpr):
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)  # this program's place among its tile's split programs (SPLIT)
        pdl.wait_prior(PDL)
        c = tl.load(TILE_CHUNK + tile)
        off = tl.load(TILE_OFF + tile)
        q_start = tl.load(Q_START + c)
        q_len = tl.load(Q_LEN + c)
        pos0 = tl.load(POS + c)
        R: tl.constexpr = BT * G_PAD
        offs_d = tl.arange(0, HD)
        t_hi = tl.minimum(off + BT, q_len)  # the tile's tokens: off .. t_hi - 1
        hi = pos0 + t_hi  # keys [lo, hi): up to the tile's last position
        # sliding window (window > 0): the first key any row of the tile may see, block-aligned
        first = tl.where(window > 0, tl.maximum(pos0 + off - window + 1, 0), 0)
        lo = first // BN * BN
        if not SPLIT:  # the default mode: one online softmax over all keys
            q, rmask, qpos, row, heads = _tile_rows(Q, q_start, q_len, pos0, off, kvh, stride_qt, stride_qh, offs_d,
                                                    G, G_PAD, R)
            m = tl.full([R], float("-inf"), tl.float32)
            l_sum = tl.zeros([R], tl.float32)
            acc = tl.zeros([R, HD], tl.float32)
            for n in tl.range(lo, hi, BN, num_stages=STAGES):
                m, l_sum, acc = _attend_block(n, q, m, l_sum, acc, K, V, TABLES, c, stride_tb, stride_ks, kvh,
                                              stride_kh, offs_d, qpos, first, hi, window, scale_log2, BS, BN, IEEE,
                                              False)
            out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
            tl.store(OUT + row[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                     out.to(OUT.dtype.element_ty), mask=rmask[:, None])
        else:
            # split sizes are non-decreasing in the position: the tile's first and last rows bound them
            s_first = _split_size(pos0 + off, window, SPLIT_MIN, SPLIT_SHIFT)
            s_last = _split_size(hi - 1, window, SPLIT_MIN, SPLIT_SHIFT)
            j_lo = lo // s_first
            nsplit = tl.cdiv(hi, s_first) - j_lo  # the tile's splits (when uniform), 0 without keys
            nsp = tl.num_programs(2)
            # the split grid where it pays: a uniform tile of several splits whose partials (its
            # rows) are less data than a split's keys (every decode row; a prompt tile at long range)
            grid = (nsp > 1) & (s_first == s_last) & (nsplit > 1) & ((t_hi - off) * G_PAD < s_first)
            if grid & (sp < nsplit):
                # program sp computes splits j_lo + sp, j_lo + sp + nsp, ... each from (-inf, 0, 0)
                # and stores their partials; the tile's last program to finish merges them
                q, rmask, qpos, row, heads = _tile_rows(Q, q_start, q_len, pos0, off, kvh, stride_qt, stride_qh,
                                                        offs_d, G, G_PAD, R)
                offs_h = row * (NKV * G) + heads  # each row's slot in the workspace
                for j in range(j_lo + sp, j_lo + nsplit, nsp):
                    m = tl.full([R], float("-inf"), tl.float32)
                    l_sum = tl.zeros([R], tl.float32)
                    acc = tl.zeros([R, HD], tl.float32)
                    for n in tl.range(tl.maximum(j * s_first, lo), tl.minimum(j * s_first + s_first, hi), BN,
                                      num_stages=STAGES):
                        m, l_sum, acc = _attend_block(n, q, m, l_sum, acc, K, V, TABLES, c, stride_tb, stride_ks,
                                                      kvh, stride_kh, offs_d, qpos, first, hi, window, scale_log2,
                                                      BS, BN, IEEE, True)
                    at = (j - j_lo).to(tl.int64) * rows_q + offs_h
                    tl.store(WS_ML + at, m, mask=rmask)
                    tl.store(WS_ML + MAX_SPLITS * rows_q + at, l_sum, mask=rmask)
                    tl.store(WS_ACC + at[:, None] * HD + offs_d[None, :], acc, mask=rmask[:, None])
                tl.debug_barrier()  # every thread's partials are stored before the (releasing) count
                cnt = CNT + tile * NKV + kvh
                if tl.atomic_add(cnt, 1, sem="acq_rel") == tl.minimum(nsp, nsplit) - 1:
                    _merge_partials(OUT, WS_ML, WS_ACC, q_start, off, t_hi, kvh, nsplit, rows_q, stride_ot, stride_oh,
                                    offs_d, NKV, G, G_PAD, HD, MAX_SPLITS)
                    tl.store(cnt, 0)  # zeroed for the next launch (graph replays reuse the buffer)
            elif sp == 0:
                # one program, the splits in turn: a row's split ends at a multiple of its own size
                # (or at the tile's end) and is merged there; the scalar test skips blocks where
                # no row's split ends (every size is a multiple of s_first)
                q, rmask, qpos, row, heads = _tile_rows(Q, q_start, q_len, pos0, off, kvh, stride_qt, stride_qh,
                                                        offs_d, G, G_PAD, R)
                s_row = _split_size(qpos, window, SPLIT_MIN, SPLIT_SHIFT)
                M = tl.full([R], float("-inf"), tl.float32)
                L = tl.zeros([R], tl.float32)
                ACC = tl.zeros([R, HD], tl.float32)
                m = tl.full([R], float("-inf"), tl.float32)
                l_sum = tl.zeros([R], tl.float32)
                acc = tl.zeros([R, HD], tl.float32)
                for n in tl.range(lo, hi, BN, num_stages=STAGES):
                    m, l_sum, acc = _attend_block(n, q, m, l_sum, acc, K, V, TABLES, c, stride_tb, stride_ks, kvh,
                                                  stride_kh, offs_d, qpos, first, hi, window, scale_log2, BS, BN, IEEE,
                                                  True)
                    nxt = n + BN
                    if (nxt % s_first == 0) | (nxt >= hi):
                        ends = (nxt % s_row == 0) | (nxt >= hi)
                        M, L, ACC = _merge(M, L, ACC, m, l_sum, acc, ends & (l_sum > 0))
                        m = tl.where(ends, float("-inf"), m)
                        l_sum = tl.where(ends, 0.0, l_sum)
                        acc = tl.where(ends[:, None], 0.0, acc)
                out = ACC / tl.where(L > 0, L, 1.0)[:, None]
                tl.store(OUT + row[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                         out.to(OUT.dtype.element_ty), mask=rmask[:, None])


_SCRATCH: dict[torch.device, torch.Tensor] = {}


def _scratch(device: torch.device) -> torch.Tensor:
    """A float32 tensor standing for the partials' workspace of a launch that has none (made
    outside a graph capture and kept; one per capture otherwise)."""
    buf = _SCRATCH.get(device)
    if buf is None:
        buf = torch.zeros(16, dtype=torch.float32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _SCRATCH[device] = buf
    return buf


def varlen_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: VarlenMeta,
                           block_size: int, scale: float | None = None, window: int = 0,
                           out: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """Causal attention of every query row of a step against its sequence's paged keys.

    The step's own keys and values must already be in the pool (:func:`monobatch.kernels.
    paged_decode.store_kv`).

    Args:
        q: ``[T, n_q, hd]`` queries (RoPE applied), unit stride along hd.
        k_cache, v_cache: ``[slots, n_kv, hd]`` one layer's pool (slot = block * block_size + offset).
        meta: the step's layout (:func:`build_meta`); ``meta.fixed_split``: deterministic mode's
            fixed KV split (module docstring).
        block_size: tokens per block.
        scale: softmax scale (default ``1 / sqrt(hd)``).
        window: sliding window in tokens (a row at position p sees keys ``p - window + 1 .. p``);
            0 = full attention.
        out: ``[T, n_q, hd]`` to write into (e.g. zeroed, so rows of no chunk hold zeros); default
            a new uninitialised tensor.
        splits: with ``meta.fixed_split``, programs per (tile, KV head) (default
            :func:`grid_splits`; 1: every tile in one program). Changes the schedule, not the bits.

    Returns:
        ``[T, n_q, hd]`` in q's dtype (``out`` if given; rows of no chunk are left as they were).

    Raises:
        RuntimeError: Triton is not installed, or head_dim is not a power of two.
    """
    T, n_q, hd = q.shape
    require_triton(hd)
    n_kv = k_cache.shape[1]
    g = n_q // n_kv
    out = torch.empty_like(q) if out is None else out
    nt = meta.num_tiles
    if nt == 0:
        return out
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    nsp = 1
    if meta.fixed_split:
        nsp = grid_splits(nt, n_kv, T, q.device) if splits is None else max(1, int(splits))
    if nsp > 1:  # partials: m and l [2, MAX_SPLITS, T * n_q], acc [MAX_SPLITS, T * n_q, hd]
        ws_ml = torch.empty(2 * MAX_SPLITS * T * n_q, dtype=torch.float32, device=q.device)
        ws_acc = torch.empty(MAX_SPLITS * T * n_q * hd, dtype=torch.float32, device=q.device)
        cnt = counters(q.device, nt * n_kv)
    elif meta.fixed_split:
        ws_ml = ws_acc = _scratch(q.device)
        cnt = counters(q.device, 1)
    else:  # the default mode's variant reads none of them
        ws_ml = ws_acc = out
        cnt = meta.tile_chunk
    _varlen_kernel[(nt, n_kv, nsp)](
        q, k_cache, v_cache, out, meta.block_tables, meta.q_start, meta.q_len, meta.pos, meta.tile_chunk,
        meta.tile_off, ws_ml, ws_acc, cnt, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        meta.block_tables.stride(0), out.stride(0), out.stride(1), T * n_q, scale * math.log2(math.e), int(window),
        NKV=n_kv, G=g, G_PAD=triton.next_power_of_2(g), HD=hd, BS=block_size, BT=meta.tokens_per_tile, BN=BLOCK_N,
        IEEE=q.dtype == torch.float32, STAGES=KV_STAGES, SPLIT=meta.fixed_split, SPLIT_MIN=SPLIT_MIN,
        SPLIT_SHIFT=SPLIT_PARTS.bit_length() - 1, MAX_SPLITS=MAX_SPLITS, num_warps=NUM_WARPS, **pdl.launch(q.device))
    return out
