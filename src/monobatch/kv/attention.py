"""Causal attention of one sequence's chunk against its cached keys and values.

Shared by every KV storage so dense and paged compute the same thing. Caches are token-major
(``[S, n_kv, hd]``): a prefix ``[:p]`` of any cache has the same strides whatever its length, so
a row's attention does not depend on the storage or on how long the cache is. GQA is done
without copying the cache: the query heads of one KV group are folded into the query-length axis.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, window: int = 0,
          key_start: int = 0) -> torch.Tensor:
    """q ``[L, n_q, hd]`` at positions ``pos..pos+L-1``; k, v ``[S, n_kv, hd]`` of positions
    ``key_start .. pos+L-1``; ``window`` > 0: a query sees only its last ``window`` positions."""
    L, n_q, hd = q.shape
    S, n_kv, _ = k.shape
    g = n_q // n_kv
    # (L, n_kv, g, hd) -> (n_kv, g*L, hd): one KV head serves g query heads.
    qg = q.view(L, n_kv, g, hd).permute(1, 2, 0, 3).reshape(n_kv, g * L, hd)
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)  # (n_kv, S, hd) views, no copy
    mask = None  # a single query token sees every key it is given
    if L > 1:
        key_pos = torch.arange(key_start, key_start + S, device=q.device)
        query_pos = torch.arange(pos, pos + L, device=q.device)
        visible = key_pos[None, :] <= query_pos[:, None]  # (L, S) causal
        if window:
            visible &= key_pos[None, :] > query_pos[:, None] - window  # the last `window` positions
        mask = visible.repeat(g, 1)  # (g*L, S)
    # 4-D inputs: torch's fused CPU kernels take the (B, heads, L, E) layout; 3-D falls back to a slow path.
    out = F.scaled_dot_product_attention(qg[None], kt[None], vt[None], attn_mask=mask)[0]  # (n_kv, g*L, hd)
    return out.view(n_kv, g, L, hd).permute(2, 0, 1, 3).reshape(L, n_q, hd)


def window_start(window: int, pos: int) -> int:
    """The first position a query at ``pos`` sees: ``max(0, pos - window + 1)``, 0 without a
    window (``window`` 0). A chunk starting at ``pos`` needs keys from there on."""
    return max(0, pos - window + 1) if window else 0


def attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, per_row: bool = False,
                 window: int = 0, key_start: int = 0) -> torch.Tensor:
    """Attention for one chunk (scaled dot product, causal, softmax scale 1/sqrt(head_dim)).

    Args:
        q: ``[L, n_q, hd]`` queries of the chunk's L tokens at positions ``pos .. pos+L-1``.
        k, v: ``[S, n_kv, hd]`` the sequence's keys/values for positions ``key_start .. pos+L-1``
            (the chunk's own keys included; ``S = pos + L - key_start``).
        pos: the position of the chunk's first token (tokens already cached before it).
        per_row: deterministic mode — each query row runs alone against exactly the keys it
            sees, the very call a decode step makes, so its result does not depend on the
            chunk's length, its place in the chunk or the cache's storage (batch invariance).
        window: a sliding-window layer's window (the query at ``p`` sees positions
            ``p - window + 1 .. p``); 0 = full causal attention (ADR 0005).
        key_start: the position of ``k[0]`` (keys before :func:`window_start` ``(window, pos)``
            are not read: the storages pass exactly that).

    Returns:
        ``[L, n_q, hd]`` in q's dtype.
    """
    L = q.shape[0]
    skip = window_start(window, pos) - key_start  # keys no query of the chunk sees
    if skip > 0:
        k, v, key_start = k[skip:], v[skip:], key_start + skip
    if not per_row or L == 1:
        return _sdpa(q, k, v, pos, window, key_start)
    rows = []
    for i in range(L):
        lo = max(window_start(window, pos + i), key_start) - key_start  # this row's first key in k
        hi = pos + i + 1 - key_start
        rows.append(_sdpa(q[i:i + 1], k[lo:hi], v[lo:hi], pos + i, window, key_start + lo))
    return torch.cat(rows)
