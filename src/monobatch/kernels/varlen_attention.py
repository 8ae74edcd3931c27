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
lengths is one launch.

Batch invariance (``--deterministic``): a row's result depends only on its own query, its keys and
the kernel's tile shape — the key blocks are aligned to absolute positions (multiples of
``BLOCK_N`` from 0), visited in ascending order, and a block wholly past a row's position (or
before its window) leaves that row's running state bit for bit unchanged (the ``m_safe`` guard
below keeps such a block from producing NaN or rescaling). So with one tile shape
(:data:`DETERMINISTIC_ROWS`) a token gets the same bits alone, in any batch, in a chunk of any
length at any offset, as a decode row or a prefill row, and on a prefix-cache hit. The default
mode picks its tile for speed (:data:`FAST_ROWS`).

Softmax scale: ``scale`` (1/sqrt(head_dim) when omitted, as
:func:`monobatch.kv.attention.attend_chunk`). The reference for tests is ``attend_chunk`` on each
chunk's gathered keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from monobatch.kernels import pdl
from monobatch.kernels.common import require_triton, tl, triton

#: Keys one loop iteration loads (a multiple of 16 for tl.dot); key blocks start at multiples of it.
BLOCK_N = 64
#: Query rows (tokens x padded query heads of one KV head) of one program in the default mode.
FAST_ROWS = 128
#: The one tile shape of deterministic mode, for decode and prefill rows alike (see the module
#: docstring): a row's bits depend on the tile shape, so it never changes with the batch.
DETERMINISTIC_ROWS = 64
#: Software-pipeline depth of the key loop.
KV_STAGES = 2


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
    """

    block_tables: torch.Tensor
    q_start: torch.Tensor
    q_len: torch.Tensor
    pos: torch.Tensor
    tile_chunk: torch.Tensor
    tile_off: torch.Tensor
    tokens_per_tile: int

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


def build_meta(chunks: Sequence[tuple[int, int, int]], tables: Sequence[Sequence[int]], bt: int,
               device: torch.device) -> VarlenMeta:
    """Lay out a step's chunks as tiles (host work, one copy to ``device``).

    Args:
        chunks: ``(q_start, q_len, pos)`` per chunk, in batch order.
        tables: each chunk's block ids (at least ``ceil((pos + q_len) / block_size)`` of them).
        bt: query tokens per tile (:func:`tokens_per_tile`).

    Returns:
        The metadata, tiles ordered by descending last position (the longest programs first, so
        the short ones fill the tail of the launch).
    """
    n = len(chunks)
    nb = max(1, max((len(t) for t in tables), default=1))
    tiles = [(0, c, o) for c, o in tile_layout(chunks, bt)]
    flat = torch.zeros(3 * n + 2 * len(tiles) + n * nb, dtype=torch.int32)
    flat[0:3 * n] = torch.tensor([v for c in chunks for v in c], dtype=torch.int32).view(n, 3).t().reshape(-1)
    if tiles:
        flat[3 * n:3 * n + 2 * len(tiles)] = torch.tensor([[c for _, c, _ in tiles], [o for _, _, o in tiles]],
                                                          dtype=torch.int32).reshape(-1)
    table_part = flat[3 * n + 2 * len(tiles):].view(n, nb)
    for i, t in enumerate(tables):
        if t:
            table_part[i, :len(t)] = torch.as_tensor(t, dtype=torch.int32)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    nt = len(tiles)
    return VarlenMeta(block_tables=flat[3 * n + 2 * nt:].view(n, nb), q_start=flat[0:n], q_len=flat[n:2 * n],
                      pos=flat[2 * n:3 * n], tile_chunk=flat[3 * n:3 * n + nt], tile_off=flat[3 * n + nt:3 * n + 2 * nt],
                      tokens_per_tile=bt)


if triton is not None:

    # stride_tb and window vary with the step (the widest table, the layer): not specialized, so a
    # row runs one binary whatever its batch (only address arithmetic would differ, but one is simpler)
    @triton.jit(do_not_specialize=["stride_tb", "window"])
    def _varlen_kernel(Q, K, V, OUT, TABLES, Q_START, Q_LEN, POS, TILE_CHUNK, TILE_OFF,
                       stride_qt, stride_qh, stride_ks, stride_kh, stride_tb, stride_ot, stride_oh,
                       scale_log2, window, G: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr,
                       BS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
                       STAGES: tl.constexpr, PDL: tl.constexpr):
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        pdl.wait_prior(PDL)
        c = tl.load(TILE_CHUNK + tile)
        off = tl.load(TILE_OFF + tile)
        q_start = tl.load(Q_START + c)
        q_len = tl.load(Q_LEN + c)
        pos0 = tl.load(POS + c)
        R: tl.constexpr = BT * G_PAD
        offs_r = tl.arange(0, R)
        tok = off + offs_r // G_PAD  # token of each row within the chunk
        head = offs_r % G_PAD
        rmask = (tok < q_len) & (head < G)
        qpos = pos0 + tok  # each row's position
        offs_d = tl.arange(0, HD)
        row = (q_start + tok).to(tl.int64)
        heads = kvh * G + head
        q = tl.load(Q + row[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=rmask[:, None], other=0.0)
        m = tl.full([R], float("-inf"), tl.float32)
        l_sum = tl.zeros([R], tl.float32)
        acc = tl.zeros([R, HD], tl.float32)
        hi = pos0 + tl.minimum(off + BT, q_len)  # keys [lo, hi): up to the tile's last position
        # sliding window (window > 0): the first key any row of the tile may see, block-aligned
        first = tl.where(window > 0, tl.maximum(pos0 + off - window + 1, 0), 0)
        lo = first // BN * BN
        for n in tl.range(lo, hi, BN, num_stages=STAGES):
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
            l_sum = l_sum * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(OUT + row[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=rmask[:, None])


def varlen_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: VarlenMeta,
                           block_size: int, scale: float | None = None, window: int = 0,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every query row of a step against its sequence's paged keys.

    The step's own keys and values must already be in the pool (:func:`monobatch.kernels.
    paged_decode.store_kv`).

    Args:
        q: ``[T, n_q, hd]`` queries (RoPE applied), unit stride along hd.
        k_cache, v_cache: ``[slots, n_kv, hd]`` one layer's pool (slot = block * block_size + offset).
        meta: the step's layout (:func:`build_meta`).
        block_size: tokens per block.
        scale: softmax scale (default ``1 / sqrt(hd)``).
        window: sliding window in tokens (a row at position p sees keys ``p - window + 1 .. p``);
            0 = full causal attention.
        out: ``[T, n_q, hd]`` to write into (e.g. zeroed, so rows of no chunk hold zeros); default
            a new uninitialised tensor.

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
    if meta.num_tiles == 0:
        return out
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    _varlen_kernel[(meta.num_tiles, n_kv)](
        q, k_cache, v_cache, out, meta.block_tables, meta.q_start, meta.q_len, meta.pos, meta.tile_chunk,
        meta.tile_off, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), meta.block_tables.stride(0),
        out.stride(0), out.stride(1), scale * math.log2(math.e), int(window), G=g,
        G_PAD=triton.next_power_of_2(g), HD=hd, BS=block_size, BT=meta.tokens_per_tile, BN=BLOCK_N,
        IEEE=q.dtype == torch.float32, STAGES=KV_STAGES, **pdl.launch(q.device))
    return out
