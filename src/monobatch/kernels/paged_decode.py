"""Paged decode attention: one query token per sequence against its KV blocks, with no host
work — the attention a captured CUDA graph replays (:mod:`monobatch.engine.cuda_graphs`).

Inputs are device tensors only (block tables and lengths included), so the call's shapes depend
on the batch size alone and a graph captured once serves every context length.

Two implementations of one contract:

* :func:`paged_decode_torch` — gather every row's blocks, mask past its length, one SDPA call.
  Runs anywhere (CPU, CUDA without Triton); its cost grows with the table width, not the length.
* :func:`paged_decode_triton` — split-K ("flash-decoding", Dao et al. 2023): each sequence's
  context is cut into ``splits`` partitions of equal length (a multiple of ``BLOCK_N`` keys and at
  least ``MIN_PART``, set from the sequence's own length inside the kernel), one program per (sequence, KV head,
  partition) runs an online softmax (Milakov & Gimelshein 2018) over its keys read straight from
  the pool through the block table, and the partitions are merged by their log-sum-exp in the
  same launch: each program holding keys stores its fp32 partial (output and log-sum-exp) and
  bumps an int32 counter of its (sequence, KV head); the program completing the count merges the
  partials in partition order (the bits do not depend on which program ended last), writes the
  output and zeroes the counter ("last program reduces", as the split-K of :mod:`monobatch.kernels.gemv`;
  both use :func:`monobatch.kernels.common.counters`). A sequence whose keys fit one partition writes its
  output directly (the same bits as a merge of one partition). Only the sequence's real keys are
  read; ``splits`` grows as the batch shrinks, so a B=1 decode keeps every SM busy at any context
  length. GQA: a program computes all query heads of its KV head. One launch, no host sync:
  CUDA-graph capturable.

:func:`store_kv` writes a step's new K and V rows into the pool at their slots (one launch for
both); :func:`paged_decode_attention` given those rows has the attention launch store them itself.

Softmax scale 1/sqrt(head_dim), as :func:`monobatch.kv.attention.attend_chunk`.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from monobatch import env
from monobatch.kernels import pdl
from monobatch.kernels.common import counters, require_triton, sm_count, tl, triton


def _splits_setting(text: str) -> tuple[int, int]:
    try:
        most, waves = (int(v) for v in text.split(","))
        if most >= 1 and most & (most - 1) == 0 and waves >= 1:
            return most, waves
    except ValueError:
        pass
    raise env.SettingError(f"MONOBATCH_DECODE_SPLITS={text!r}: expected 'MAX_SPLITS,WAVES', a power of two and a positive integer")


#: Most partitions one sequence's keys are split into (programs per sequence and KV head), and
#: programs per SM the split count aims for (B * n_kv * splits ~ SPLIT_WAVES * SMs).
#: ``MONOBATCH_DECODE_SPLITS=64,4`` overrides both (A/B runs).
MAX_SPLITS, SPLIT_WAVES = _splits_setting(env.text("MONOBATCH_DECODE_SPLITS") or "64,2")
#: Keys one loop iteration of the Triton kernel loads (a multiple of 16 for tl.dot, a power of
#: two); partitions are multiples of it. ``MONOBATCH_DECODE_BLOCK_N`` overrides it (A/B runs).
BLOCK_N = env.fatal_integer("MONOBATCH_DECODE_BLOCK_N", 64, minimum=16, power_of_two=True)
#: Fewest keys a partition takes (a multiple of :data:`BLOCK_N`; the default, one block, sets no
#: minimum beyond it). Larger values were measured slower on the H200 (2026-12-03, llama-1b B=1,
#: same call: 256 keys a partition at a 256-key context 1,059 against 1,155 tok/s with 64; 1,024
#: keys at a 1,024-key context 784 against 1,061 with 256): one program walking more key blocks costs more than the
#: merge it saves. ``MONOBATCH_DECODE_MIN_PART`` sets it (A/B runs).
MIN_PART = env.fatal_integer("MONOBATCH_DECODE_MIN_PART", BLOCK_N)
if MIN_PART % BLOCK_N:
    raise env.SettingError(f"MONOBATCH_DECODE_MIN_PART={MIN_PART}: expected a multiple of {BLOCK_N}")
#: Software-pipeline depth of the kernel's key loop (``tl.range(num_stages=)``): iterations whose
#: loads are in flight at once. ``MONOBATCH_DECODE_STAGES`` overrides it (A/B runs).
KV_STAGES = env.fatal_integer("MONOBATCH_DECODE_STAGES", 2)
#: Warps of one program of the Triton kernel. ``MONOBATCH_DECODE_WARPS`` overrides it (A/B runs).
NUM_WARPS = env.fatal_integer("MONOBATCH_DECODE_WARPS", 4, maximum=32, power_of_two=True)
#: Let the next kernel (the o projection) launch only as the programs exit (no trigger), not right
#: after the PDL wait: its early programs then neither hold SM slots nor queue weight loads while
#: the attention's programs still work. ``MONOBATCH_DECODE_LATE_TRIGGER=1`` (A/B runs).
LATE_TRIGGER = env.flag("MONOBATCH_DECODE_LATE_TRIGGER", False)
#: Store a step's new K/V rows inside the attention launch (:func:`paged_decode_attention`);
#: False: a separate :func:`store_kv` launch first (A/B runs).
FOLD_STORE = True


def num_splits(batch: int, n_kv: int, max_keys: int, device: torch.device) -> int:
    """Partitions per (sequence, KV head): enough programs to fill the GPU :data:`SPLIT_WAVES`
    times over (``SPLIT_WAVES * SMs / (batch * n_kv)``, at most :data:`MAX_SPLITS`, and no more than ``max_keys /
    BLOCK_N``), a power of two. A function of the batch shape only, so a captured graph keeps it."""
    want = triton.next_power_of_2(max(1, -(-SPLIT_WAVES * sm_count(device) // (batch * n_kv))))
    blocks = max(1, -(-max_keys // BLOCK_N))
    return min(want, MAX_SPLITS, 1 << (blocks.bit_length() - 1))  # a power of two (tl.arange)


def paged_decode_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, block_size: int, window: int = 0) -> torch.Tensor:
    """Reference paged decode attention (gather + masked SDPA).

    Args:
        q: ``[B, n_q, hd]`` the query of each sequence's newest token.
        k_cache, v_cache: ``[slots, n_kv, hd]`` one layer's pool (slot = block * block_size + offset).
        block_tables: ``[B, nb]`` int32/int64 block ids in position order (unused entries any valid id).
        seq_lens: ``[B]`` int keys each sequence attends to (its newest token included), >= 1.
        block_size: tokens per block.
        window: a sliding-window layer's window (only keys ``seq_len - window .. seq_len - 1``
            are seen; the table's entries before them may be any valid id); 0 = every key.
            Slots outside what a row sees are never read into its result (any bits there, NaN
            included, leave it unchanged).

    Returns:
        ``[B, n_q, hd]`` in q's dtype.
    """
    B, n_q, hd = q.shape
    n_kv = k_cache.shape[1]
    g = n_q // n_kv
    nb = block_tables.shape[1]
    slots = (block_tables.long()[:, :, None] * block_size
             + torch.arange(block_size, device=q.device)).reshape(B, nb * block_size)  # (B, S)
    keys = k_cache[slots].transpose(1, 2)  # (B, n_kv, S, hd)
    values = v_cache[slots].transpose(1, 2)
    key_pos = torch.arange(nb * block_size, device=q.device)[None, :]
    mask = key_pos < seq_lens.long()[:, None]  # (B, S)
    if window:  # entries before the window may be released blocks (the scratch block)
        mask &= key_pos >= seq_lens.long()[:, None] - window
    # Slots the mask hides are never written or were freed (the pool is torch.empty): NaN or Inf
    # there would reach the output through SDPA (a NaN score survives the -inf mask, and 0 * NaN
    # is NaN in p @ V), so they are zeroed, not only masked.
    keys = keys.masked_fill(~mask[:, None, :, None], 0.0)
    values = values.masked_fill(~mask[:, None, :, None], 0.0)
    qg = q.view(B, n_kv, g, hd)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask[:, None, None, :])  # (B, n_kv, g, hd)
    return out.reshape(B, n_q, hd)


if triton is not None:

    @triton.jit
    def _attend_tile(q, k, v, nmask, m, l_sum, acc, scale, IEEE: tl.constexpr):
        # one key tile of the online softmax: q (G_PAD, HD), k and v (BN, HD), nmask (BN,) ->
        # (m, l_sum, acc) updated
        if IEEE:  # float32 inputs: full-precision products, as the eager path (not TF32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (G_PAD, BN) float32
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_sum, acc

    @triton.jit
    def _key_tile(K, V, table, n, end, kvh, stride_ks, stride_kh, offs_d, BS: tl.constexpr, BN: tl.constexpr):
        # keys n .. n + BN - 1 of one sequence (``table``: its block table row), KV head kvh ->
        # (positions (BN,), their mask (< end), k and v (BN, HD), 0 past the mask)
        offs_n = n + tl.arange(0, BN)
        nmask = offs_n < end
        blk = tl.load(table + offs_n // BS, mask=nmask, other=0).to(tl.int64)
        kv_off = (blk * BS + offs_n % BS)[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
        k = tl.load(K + kv_off, mask=nmask[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=nmask[:, None], other=0.0)
        return offs_n, nmask, k, v

    @triton.jit
    def _partition_kernel(Q, K, V, TABLES, LENS, O_PART, LSE_PART, OUT, CNT, K_NEW, V_NEW, SLOTS,
                          stride_qb, stride_qh, stride_ks, stride_kh, stride_tb, stride_knb, stride_knh,
                          stride_vnb, stride_vnh,
                          stride_ob, stride_oh, stride_op, stride_lb, stride_lh, stride_outb, stride_outh,
                          scale, window, NKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr,
                          BS: tl.constexpr, SPLITS: tl.constexpr, BN: tl.constexpr, MIN_PART: tl.constexpr,
                          IEEE: tl.constexpr, STAGES: tl.constexpr, STORE: tl.constexpr, LATE: tl.constexpr,
                          PDL: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        part = tl.program_id(2)
        # Before the PDL wait: the length, the block table and the partition's first key tile. No
        # kernel of the step writes them but the newest key and value row, which is taken after the
        # wait (STORE: from this launch's inputs, which it then stores; else from the pool, where
        # the kernel before stored it) and put in place of the tile's row (kernels/pdl.py's rule:
        # the lengths and tables are the host's copies, the older keys earlier steps' writes).
        seq_len = tl.load(LENS + b)
        # keys lo .. seq_len - 1: all of them, or a sliding window's last `window` (ADR 0005)
        lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
        # this sequence's partition length: SPLITS of them cover its keys, each at least MIN_PART
        part_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len - lo, SPLITS), BN) * BN, MIN_PART)
        nparts = tl.cdiv(seq_len - lo, part_len)  # partitions holding keys (the others do nothing)
        start = lo + part * part_len
        end = tl.minimum(start + part_len, seq_len)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, HD)
        heads = kvh * G + offs_g
        gmask = offs_g < G
        last = seq_len - 1  # the newest token's position
        has_last = (start <= last) & (last < end)
        offs_n, nmask, k0, v0 = _key_tile(K, V, TABLES + b * stride_tb, start, end, kvh, stride_ks, stride_kh, offs_d,
                                          BS, BN)
        if not STORE:  # the newest row's slot (its key and value are read after the wait)
            last_blk = tl.load(TABLES + b * stride_tb + last // BS, mask=has_last, other=0).to(tl.int64)
            last_off = (last_blk * BS + last % BS) * stride_ks + kvh * stride_kh + offs_d
        if LATE:  # no trigger: the next grid launches as this one's programs exit
            pdl.wait_only(PDL)
        else:
            pdl.wait_prior(PDL)
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, HD], tl.float32)
        if STORE:  # the step's new K/V row: the program whose partition holds it writes it to its slot
            k_new = tl.load(K_NEW + b * stride_knb + kvh * stride_knh + offs_d)
            v_new = tl.load(V_NEW + b * stride_vnb + kvh * stride_vnh + offs_d)
            if has_last:
                slot = tl.load(SLOTS + b).to(tl.int64)
                tl.store(K + slot * stride_ks + kvh * stride_kh + offs_d, k_new)
                tl.store(V + slot * stride_ks + kvh * stride_kh + offs_d, v_new)
        else:  # the newest row as the kernel before stored it (from L2: .cg, never a line cached before the wait)
            dmask = has_last & (offs_d >= 0)
            k_new = tl.load(K + last_off, mask=dmask, other=0.0, cache_modifier=".cg")
            v_new = tl.load(V + last_off, mask=dmask, other=0.0, cache_modifier=".cg")
        if start < end:  # the first tile (loaded before the wait), its newest row replaced
            is_new = (offs_n == last)[:, None]
            m, l_sum, acc = _attend_tile(q, tl.where(is_new, k_new[None, :], k0), tl.where(is_new, v_new[None, :], v0),
                                         nmask, m, l_sum, acc, scale, IEEE)
        # the partition's other tiles, software-pipelined (STAGES): the block ids, K and V of later
        # iterations are loaded while this one computes; V is loaded with K, not after the softmax
        for n in tl.range(start + BN, end, BN, num_stages=STAGES):
            offs_n, nmask, k, v = _key_tile(K, V, TABLES + b * stride_tb, n, end, kvh, stride_ks, stride_kh, offs_d,
                                            BS, BN)
            is_new = (offs_n == last)[:, None]  # the newest key and value from after the wait
            m, l_sum, acc = _attend_tile(q, tl.where(is_new, k_new[None, :], k), tl.where(is_new, v_new[None, :], v),
                                         nmask, m, l_sum, acc, scale, IEEE)
        has = l_sum > 0
        out = acc / tl.where(has, l_sum, 1.0)[:, None]
        if start < seq_len:
            if nparts == 1:
                # The only partition: the merge would weigh it by exp(lse - max lse) = 1 and the
                # empty ones by 0, i.e. out * 1 + 0 + ... + 0, / 1: the same bits as out + 0.0
                # (the "+ 0" turns a -0.0 into +0.0 as the merge's sum does; with one split there
                # is nothing to add). So it writes the result itself, no partials, no counter.
                if SPLITS > 1:
                    res = out + 0.0
                else:
                    res = out
                tl.store(OUT + b * stride_outb + heads[:, None] * stride_outh + offs_d[None, :],
                         res.to(OUT.dtype.element_ty), mask=gmask[:, None])
            else:
                lse = tl.where(has, m + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
                o_ptr = O_PART + b * stride_ob + heads[:, None] * stride_oh + part * stride_op + offs_d[None, :]
                tl.store(o_ptr, out, mask=gmask[:, None])
                tl.store(LSE_PART + b * stride_lb + heads * stride_lh + part, lse, mask=gmask)
                tl.debug_barrier()  # every thread's partial is stored before the (releasing) count
                # Fused merge (the "last program reduces" pattern of gemv.py's split-K): the
                # program completing the count of this (sequence, KV head) merges the partials of
                # its G query heads by their log-sum-exp, in partition order 0..nparts-1 whatever
                # the arrival order, so the bits do not depend on which program ended last.
                cnt = CNT + b * NKV + kvh
                if tl.atomic_add(cnt, 1, sem="acq_rel") == nparts - 1:
                    offs_p = tl.arange(0, SPLITS)
                    pmask = offs_p < nparts
                    for g in tl.static_range(G):  # unrolled: the heads' loads in flight together
                        h = kvh * G + g
                        lse_p = tl.load(LSE_PART + b * stride_lb + h * stride_lh + offs_p, mask=pmask,
                                        other=float("-inf"), cache_modifier=".cg")
                        w = tl.exp(lse_p - tl.max(lse_p, 0))  # partitions past the length: exp(-inf) = 0
                        o = tl.load(O_PART + b * stride_ob + h * stride_oh + offs_p[:, None] * stride_op
                                    + offs_d[None, :], mask=pmask[:, None], other=0.0, cache_modifier=".cg")
                        merged = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
                        tl.store(OUT + b * stride_outb + h * stride_outh + offs_d, merged.to(OUT.dtype.element_ty))
                    tl.store(cnt, 0)  # zeroed for the next launch (graph replays reuse the buffer)

    @triton.jit
    def _store_kv_kernel(K, V, K_CACHE, V_CACHE, SLOTS, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_cs, stride_ch, NKV: tl.constexpr, NKV_PAD: tl.constexpr, HD: tl.constexpr,
                         PDL: tl.constexpr):
        t = tl.program_id(0)
        pdl.wait_prior(PDL)
        slot = tl.load(SLOTS + t).to(tl.int64)
        offs_h = tl.arange(0, NKV_PAD)
        offs_d = tl.arange(0, HD)
        mask = (offs_h < NKV)[:, None]
        dst = slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
        k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        tl.store(K_CACHE + dst, k, mask=mask)
        v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        tl.store(V_CACHE + dst, v, mask=mask)


def paged_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, block_size: int, k_new: torch.Tensor | None = None,
                        v_new: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                        window: int = 0) -> torch.Tensor:
    """Split-K paged decode attention in Triton; same contract as :func:`paged_decode_torch`.

    With ``k_new``/``v_new`` (``[B, n_kv, hd]``, unit stride along hd) and ``slot_mapping``
    (``[B]``): the step's new K/V rows are stored into the pool by the same launch (the program
    whose partition holds each sequence's newest position writes it, and uses it from the inputs),
    the result of :func:`store_kv` then attention, one launch fewer.

    The number of partitions (:func:`num_splits`) depends on the batch shape only, so it is fixed
    for a captured graph; their length follows each sequence's own length, partitions past it
    compute and store nothing, and the merge (in the same launch, by the last partition of each
    sequence and KV head to finish) reads only the ones holding keys, so the work follows the
    real lengths. ``window`` > 0 (a sliding-window layer): the partitions cover only the keys
    ``seq_len - window .. seq_len - 1``, so table entries before them are never read (paged
    storage points released blocks at the scratch block). float32 inputs use IEEE (not TF32) products. The split counters are
    :func:`monobatch.kernels.common.counters`' per-device buffer (left zeroed by every launch;
    calls on several streams at once are not supported).

    Raises:
        RuntimeError: Triton is not installed, or head_dim is not a power of two.
        ValueError: ``k_new``/``v_new`` not ``[B, n_kv, hd]`` in the pool's dtype with unit stride
            along hd, or ``slot_mapping`` missing or not ``[B]``.
    """
    B, n_q, hd = q.shape
    require_triton(hd)
    n_kv = k_cache.shape[1]
    g = n_q // n_kv
    parts = num_splits(B, n_kv, block_tables.shape[1] * block_size, q.device)
    o_part = torch.empty(B, n_q, parts, hd, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, n_q, parts, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    cnt = counters(q.device, B * n_kv)
    store = k_new is not None
    if store:
        rows = (B, n_kv, hd)
        if (v_new is None or slot_mapping is None or tuple(k_new.shape) != rows or tuple(v_new.shape) != rows
                or k_new.dtype != k_cache.dtype or v_new.dtype != v_cache.dtype or tuple(slot_mapping.shape) != (B,)
                or k_new.stride(-1) != 1 or v_new.stride(-1) != 1):
            raise ValueError(f"k_new/v_new must be {list(rows)} in the pool's dtype with unit stride along hd, "
                             f"with slot_mapping [{B}]")
    else:
        k_new = v_new = q  # unused
        slot_mapping = seq_lens
    _partition_kernel[(B, n_kv, parts)](
        q, k_cache, v_cache, block_tables, seq_lens, o_part, lse, out, cnt, k_new, v_new, slot_mapping,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), 1.0 / math.sqrt(hd), int(window), NKV=n_kv, G=g,
        G_PAD=max(16, triton.next_power_of_2(g)), HD=hd, BS=block_size, SPLITS=parts, BN=BLOCK_N, MIN_PART=MIN_PART,
        IEEE=q.dtype == torch.float32, STAGES=KV_STAGES, STORE=store, LATE=LATE_TRIGGER, num_warps=NUM_WARPS,
        **pdl.launch(q.device))
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write row t of ``k``/``v`` (``[T, n_kv, hd]``, any row/head strides) into slot
    ``slot_mapping[t]`` of ``k_cache``/``v_cache`` (``[slots, n_kv, hd]``): ``index_copy_`` of
    both in one launch where Triton runs (CUDA), the two ``index_copy_`` calls elsewhere."""
    T, n_kv, hd = k.shape
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # tests run the kernel on CPU tensors
    if not (triton is not None and (k.is_cuda or interpreted) and hd & (hd - 1) == 0 and k.stride(-1) == 1 and v.stride(-1) == 1):
        k_cache.index_copy_(0, slot_mapping, k)
        v_cache.index_copy_(0, slot_mapping, v)
        return
    if T:
        _store_kv_kernel[(T,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               k_cache.stride(0), k_cache.stride(1), NKV=n_kv, NKV_PAD=triton.next_power_of_2(n_kv),
                               HD=hd, **pdl.launch(k.device))


def triton_usable(device: torch.device, head_dim: int) -> bool:
    """True when :func:`paged_decode_triton` can run here (CUDA, Triton present, power-of-two
    head_dim)."""
    return triton is not None and device.type == "cuda" and head_dim & (head_dim - 1) == 0


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, block_size: int, k_new: torch.Tensor | None = None,
                           v_new: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                           window: int = 0) -> torch.Tensor:
    """Paged decode attention: the Triton kernel where usable, else the torch reference.
    Contract: :func:`paged_decode_torch` (``window``: a sliding-window layer's). With ``k_new``,
    ``v_new`` and ``slot_mapping`` the step's new rows are first written to the pool
    (:func:`store_kv`; inside the attention launch on the Triton path, see :func:`paged_decode_triton`)."""
    if triton_usable(q.device, q.shape[-1]):
        fold = FOLD_STORE and k_new is not None and k_new.stride(-1) == 1 and v_new.stride(-1) == 1
        if k_new is not None and not fold:
            store_kv(k_new, v_new, k_cache, v_cache, slot_mapping)
        return paged_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, block_size,
                                   *((k_new, v_new, slot_mapping) if fold else ()), window=window)
    if k_new is not None:
        store_kv(k_new, v_new, k_cache, v_cache, slot_mapping)
    return paged_decode_torch(q, k_cache, v_cache, block_tables, seq_lens, block_size, window)
