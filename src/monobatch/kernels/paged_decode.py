"""Paged decode attention: one query token per sequence against its KV blocks, with no host
work — the attention a captured CUDA graph replays (:mod:`monobatch.engine.cuda_graphs`).

Inputs are device tensors only (block tables and lengths included), so the call's shapes depend
on the batch size alone and a graph captured once serves every context length.

Two implementations of one contract:

* :func:`paged_decode_torch` — gather every row's blocks, mask past its length, one SDPA call.
  Runs anywhere (CPU, CUDA without Triton); its cost grows with the table width, not the length.
* :func:`paged_decode_triton` — split-K ("flash-decoding", Dao et al. 2023): the context is cut
  into partitions of ``PARTITION`` tokens, one program per (sequence, KV head, partition) runs an
  online softmax (Milakov & Gimelshein 2018) over its keys read straight from the pool through
  the block table, and the partitions are merged by their log-sum-exp. Only the sequence's real
  keys are read. GQA: a program computes all query heads of its KV head at once.

Softmax scale 1/sqrt(head_dim), as :func:`monobatch.kv.attention.attend_chunk`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of torch; CPU-only installs have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None

#: Tokens of one split-K partition (one program's share of a sequence's keys).
PARTITION = 512
#: Keys one loop iteration of the Triton kernel loads (a multiple of 16 for tl.dot).
BLOCK_N = 64


def paged_decode_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Reference paged decode attention (gather + masked SDPA).

    Args:
        q: ``[B, n_q, hd]`` the query of each sequence's newest token.
        k_cache, v_cache: ``[slots, n_kv, hd]`` one layer's pool (slot = block * block_size + offset).
        block_tables: ``[B, nb]`` int32/int64 block ids in position order (unused entries any valid id).
        seq_lens: ``[B]`` int keys each sequence attends to (its newest token included), >= 1.
        block_size: tokens per block.

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
    mask = torch.arange(nb * block_size, device=q.device)[None, :] < seq_lens.long()[:, None]  # (B, S)
    qg = q.view(B, n_kv, g, hd)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask[:, None, None, :])  # (B, n_kv, g, hd)
    return out.reshape(B, n_q, hd)


if triton is not None:

    @triton.jit
    def _partition_kernel(Q, K, V, TABLES, LENS, O_PART, LSE_PART,
                          stride_qb, stride_qh, stride_ks, stride_kh, stride_tb,
                          stride_ob, stride_oh, stride_op, stride_lb, stride_lh,
                          scale, G: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
                          PART: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        part = tl.program_id(2)
        seq_len = tl.load(LENS + b)
        start = part * PART
        end = tl.minimum(start + PART, seq_len)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, HD)
        heads = kvh * G + offs_g
        gmask = offs_g < G
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, HD], tl.float32)
        for n in range(start, end, BN):
            offs_n = n + tl.arange(0, BN)
            nmask = offs_n < end
            blk = tl.load(TABLES + b * stride_tb + offs_n // BS, mask=nmask, other=0).to(tl.int64)
            slots = blk * BS + offs_n % BS
            kv_off = slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
            k = tl.load(K + kv_off, mask=nmask[:, None], other=0.0)  # (BN, HD)
            if IEEE:  # float32 inputs: full-precision products, as the eager path (not TF32)
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (G_PAD, BN) float32
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l_sum = l_sum * alpha + tl.sum(p, 1)
            v = tl.load(V + kv_off, mask=nmask[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        has = l_sum > 0
        out = acc / tl.where(has, l_sum, 1.0)[:, None]
        lse = tl.where(has, m + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
        used = gmask & ((offs_g * 0 + start) < seq_len)  # partitions past the length store nothing (the merge skips them)
        o_ptr = O_PART + b * stride_ob + heads[:, None] * stride_oh + part * stride_op + offs_d[None, :]
        tl.store(o_ptr, out, mask=used[:, None])
        tl.store(LSE_PART + b * stride_lb + heads * stride_lh + part, lse, mask=used)

    @triton.jit
    def _merge_kernel(O_PART, LSE_PART, LENS, OUT, stride_ob, stride_oh, stride_op, stride_lb, stride_lh,
                      stride_outb, stride_outh, P_PAD: tl.constexpr, HD: tl.constexpr, PART: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_p = tl.arange(0, P_PAD)
        offs_d = tl.arange(0, HD)
        pmask = offs_p < tl.cdiv(tl.load(LENS + b), PART)  # only the partitions holding keys
        lse = tl.load(LSE_PART + b * stride_lb + h * stride_lh + offs_p, mask=pmask, other=float("-inf"))
        w = tl.exp(lse - tl.max(lse, 0))  # empty partitions: exp(-inf) = 0
        o = tl.load(O_PART + b * stride_ob + h * stride_oh + offs_p[:, None] * stride_op + offs_d[None, :],
                    mask=pmask[:, None], other=0.0)
        out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        tl.store(OUT + b * stride_outb + h * stride_outh + offs_d, out.to(OUT.dtype.element_ty))


def paged_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Split-K paged decode attention in Triton; same contract as :func:`paged_decode_torch`.

    The number of partitions follows the table width (``nb * block_size / PARTITION``), so it
    is fixed for a captured graph; partitions past a sequence's length compute and store
    nothing, and the merge reads only ``ceil(len / PARTITION)`` of them, so the work follows the
    real lengths. float32 inputs use IEEE (not TF32) products.

    Raises:
        RuntimeError: Triton is not installed, or head_dim is not a power of two.
    """
    if triton is None:
        raise RuntimeError("Triton is not installed")
    B, n_q, hd = q.shape
    n_kv = k_cache.shape[1]
    if hd & (hd - 1):
        raise RuntimeError(f"head_dim {hd} is not a power of two")
    g = n_q // n_kv
    parts = max(1, -(-block_tables.shape[1] * block_size // PARTITION))
    o_part = torch.empty(B, n_q, parts, hd, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, n_q, parts, dtype=torch.float32, device=q.device)
    _partition_kernel[(B, n_kv, parts)](
        q, k_cache, v_cache, block_tables, seq_lens, o_part, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        1.0 / math.sqrt(hd), G=g, G_PAD=max(16, triton.next_power_of_2(g)), HD=hd, BS=block_size,
        PART=PARTITION, BN=BLOCK_N, IEEE=q.dtype == torch.float32)
    # Merge the partitions by their log-sum-exp: weights exp(lse_p - max lse) (0 for empty ones).
    out = torch.empty_like(q)
    _merge_kernel[(B, n_q)](o_part, lse, seq_lens, out, o_part.stride(0), o_part.stride(1), o_part.stride(2),
                            lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
                            P_PAD=triton.next_power_of_2(parts), HD=hd, PART=PARTITION)
    return out


def triton_usable(device: torch.device, head_dim: int) -> bool:
    """True when :func:`paged_decode_triton` can run here (CUDA, Triton present, power-of-two
    head_dim)."""
    return triton is not None and device.type == "cuda" and head_dim & (head_dim - 1) == 0


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Paged decode attention: the Triton kernel where usable, else the torch reference.
    Contract: :func:`paged_decode_torch`."""
    if triton_usable(q.device, q.shape[-1]):
        return paged_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, block_size)
    return paged_decode_torch(q, k_cache, v_cache, block_tables, seq_lens, block_size)
