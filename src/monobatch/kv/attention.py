"""Causal attention of one sequence's chunk against its cached keys and values.

Shared by every KV storage so dense and paged compute the same thing. Caches are token-major
(``[S, n_kv, hd]``): a prefix ``[:p]`` of any cache has the same strides whatever its length, so
a row's attention does not depend on the storage or on how long the cache is. GQA is done
without copying the cache: the query heads of one KV group are folded into the query-length axis.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int) -> torch.Tensor:
    """q ``[L, n_q, hd]`` at positions ``pos..pos+L-1``; k, v ``[S, n_kv, hd]`` with S = pos + L."""
    L, n_q, hd = q.shape
    S, n_kv, _ = k.shape
    g = n_q // n_kv
    # (L, n_kv, g, hd) -> (n_kv, g*L, hd): one KV head serves g query heads.
    qg = q.view(L, n_kv, g, hd).permute(1, 2, 0, 3).reshape(n_kv, g * L, hd)
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)  # (n_kv, S, hd) views, no copy
    mask = None  # a single query token sees every cached key
    if L > 1:
        key_pos = torch.arange(S, device=q.device)
        query_pos = torch.arange(pos, pos + L, device=q.device)
        mask = (key_pos[None, :] <= query_pos[:, None]).repeat(g, 1)  # (g*L, S)
    # 4-D inputs: torch's fused CPU kernels take the (B, heads, L, E) layout; 3-D falls back to a slow path.
    out = F.scaled_dot_product_attention(qg[None], kt[None], vt[None], attn_mask=mask)[0]  # (n_kv, g*L, hd)
    return out.view(n_kv, g, L, hd).permute(2, 0, 1, 3).reshape(L, n_q, hd)


def attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, per_row: bool = False) -> torch.Tensor:
    """Attention for one chunk (scaled dot product, causal, softmax scale 1/sqrt(head_dim)).

    Args:
        q: ``[L, n_q, hd]`` queries of the chunk's L tokens at positions ``pos .. pos+L-1``.
        k, v: ``[S, n_kv, hd]`` the sequence's keys/values for positions ``0 .. S-1``, with
            ``S = pos + L`` (the chunk's own keys included).
        pos: the position of the chunk's first token (tokens already cached before it).
        per_row: deterministic mode — each query row runs alone against exactly its ``p + 1``
            keys, the very call a decode step makes, so its result does not depend on the
            chunk's length, its place in the chunk or the cache's storage (batch invariance).

    Returns:
        ``[L, n_q, hd]`` in q's dtype.
    """
    L = q.shape[0]
    if not per_row or L == 1:
        return _sdpa(q, k, v, pos)
    return torch.cat([_sdpa(q[i:i + 1], k[:pos + i + 1], v[:pos + i + 1], pos + i) for i in range(L)])
