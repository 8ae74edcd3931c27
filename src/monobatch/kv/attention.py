"""Causal attention of one sequence's chunk against its cached keys and values.

Shared by every KV storage so dense and paged compute the same thing. GQA is done without
copying the cache: the query heads of one KV group are folded into the query-length axis.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int) -> torch.Tensor:
    """Attention for one chunk (scaled dot product, causal, softmax scale 1/sqrt(head_dim)).

    Args:
        q: ``[L, n_q, hd]`` queries of the chunk's L tokens at positions ``pos .. pos+L-1``.
        k, v: ``[n_kv, S, hd]`` the sequence's keys/values for positions ``0 .. S-1``, with
            ``S = pos + L`` (the chunk's own keys included).
        pos: the position of the chunk's first token (tokens already cached before it).

    Returns:
        ``[L, n_q, hd]`` in q's dtype.
    """
    L, n_q, hd = q.shape
    n_kv, S, _ = k.shape
    g = n_q // n_kv
    # (L, n_kv, g, hd) -> (n_kv, g*L, hd): one KV head serves g query heads.
    qg = q.view(L, n_kv, g, hd).permute(1, 2, 0, 3).reshape(n_kv, g * L, hd)
    mask = None  # a single query token sees every cached key
    if L > 1:
        key_pos = torch.arange(S, device=q.device)
        query_pos = torch.arange(pos, pos + L, device=q.device)
        mask = (key_pos[None, :] <= query_pos[:, None]).repeat(g, 1)  # (g*L, S)
    # 4-D inputs: torch's fused CPU kernels take the (B, heads, L, E) layout; 3-D falls back to a slow path.
    out = F.scaled_dot_product_attention(qg[None], k[None], v[None], attn_mask=mask)[0]  # (n_kv, g*L, hd)
    return out.view(n_kv, g, L, hd).permute(2, 0, 1, 3).reshape(L, n_q, hd)
