"""Greedy argmax of float32 logit rows on CUDA (Triton): the decode step's ``logits.argmax(-1)``.

torch's CUDA reduce of one ``[1, 49152]`` float32 row runs in a single block (~16 us on an H200)
for what is 192 KB of reads. Here the row is cut into C chunks of ``BLOCK`` columns (C = 24 for
a vocabulary of 49152, 32 for 128256), one program per (row, chunk) reduces its chunk to (value,
first index) and stores it in an fp32/int64 workspace ``[R, C]``, and the partials are reduced in
the same launch: each program bumps an int32 counter of its row and the one completing the count
reduces the row's C partials in chunk order and writes the index ("last program reduces", as the
split-K of :mod:`monobatch.kernels.gemv`, with the per-device counter buffer of
:func:`monobatch.kernels.common.counters`, left zeroed). A row of one chunk is written directly. One launch, no host sync, no data-dependent
allocation: CUDA-graph capturable.

The result is exactly ``torch.argmax(x, dim=-1)``'s: the first index of the maximum; NaN counts
as larger than everything (the first NaN's index, even after a +inf); a row of -inf gives 0.

``MONOBATCH_TRITON_ARGMAX=0`` turns the kernel off (torch's argmax everywhere).
"""

from __future__ import annotations

import os

import torch

from monobatch import env
from monobatch.kernels.common import counters, tl, triton

_ON = env.flag("MONOBATCH_TRITON_ARGMAX", True)
#: Chunks a row is cut into at most while 4096-column chunks suffice (up to 131072 columns);
#: chunks hold 1024-4096 columns, so wider rows get more chunks.
_CHUNKS = 32


def _block(V: int) -> int:
    """Columns per program: a power of two in [1024, 4096] giving <= :data:`_CHUNKS` chunks where
    it can (wider vocabularies get more chunks of 4096)."""
    return min(4096, max(1024, 1 << (max(1, -(-V // _CHUNKS)) - 1).bit_length()))


if triton is not None:

    @triton.jit
    def _first_max(v, idx, mask, BIG):
        # (value, index) of torch.argmax over the masked-in lanes of v: the lowest index of a NaN
        # if any, else the lowest index holding the maximum; BIG is an index past every real one
        nan = mask & (v != v)
        v = tl.where(mask & ~nan, v, float("-inf"))
        m = tl.max(v, 0)
        first_nan = tl.min(tl.where(nan, idx, BIG), 0)
        first_max = tl.min(tl.where(mask & (v == m), idx, BIG), 0)
        has_nan = first_nan < BIG
        return tl.where(has_nan, float("nan"), m), tl.where(has_nan, first_nan, first_max)

    @triton.jit
    def _argmax_kernel(X, OUT, WS_V, WS_I, CNT, V, stride_x, C,
                       BLOCK: tl.constexpr, C_PAD: tl.constexpr, SPLIT: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(X + row.to(tl.int64) * stride_x + offs, mask=mask, other=float("-inf"))
        val, idx = _first_max(x, offs.to(tl.int64), mask, V)
        if SPLIT:
            tl.store(WS_V + row * C + chunk, val)
            tl.store(WS_I + row * C + chunk, idx)
            tl.debug_barrier()  # the partial is stored before the (releasing) count
            # The program completing this row's count reduces its C partials with the same rule,
            # in chunk order whatever the arrival order (chunk c's indices all precede chunk
            # c+1's, so "lowest index" = "earliest chunk" and the result is torch's).
            if tl.atomic_add(CNT + row, 1, sem="acq_rel") == C - 1:
                offs_c = tl.arange(0, C_PAD)
                cmask = offs_c < C
                vals = tl.load(WS_V + row * C + offs_c, mask=cmask, other=float("-inf"), cache_modifier=".cg")
                idxs = tl.load(WS_I + row * C + offs_c, mask=cmask, other=0, cache_modifier=".cg")
                tl.store(OUT + row, _first_max(vals, idxs, cmask, V)[1])
                tl.store(CNT + row, 0)  # zeroed for the next launch (graph replays reuse the buffer)
        else:
            tl.store(OUT + row, idx)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of float32 rows: the Triton kernel on CUDA, else torch.

    Args:
        x: ``[R, V]`` float32 logits (R >= 0, V >= 1), unit stride along V (rows may be padded).
            Anything else (another dtype or rank, a CPU tensor, no Triton, or
            ``MONOBATCH_TRITON_ARGMAX=0``) goes to ``torch.argmax``; with ``TRITON_INTERPRET=1``
            CPU float32 tensors run the kernel in the interpreter (the tests).

    Returns:
        ``[R]`` int64 on x's device, as torch.argmax: the first index of each row's maximum, the
        first NaN's index where a row has a NaN, 0 for a row of -inf. The split counters are
        :func:`monobatch.kernels.common.counters`' per-device buffer (left zeroed; calls on
        several streams at once are not supported).
    """
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # tests run the kernel on CPU tensors
    if not (_ON and triton is not None and (x.is_cuda or interpreted) and x.dtype == torch.float32
            and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1):
        return x.argmax(dim=-1)
    R, V = x.shape
    out = torch.empty(R, dtype=torch.int64, device=x.device)
    if R == 0:
        return out
    block = _block(V)
    C = -(-V // block)
    if C > 1:
        ws_v = torch.empty((R, C), dtype=torch.float32, device=x.device)
        ws_i = torch.empty((R, C), dtype=torch.int64, device=x.device)
        cnt = counters(x.device, R)
    else:  # one chunk: the program writes the index itself (no workspace, no counter)
        ws_v = ws_i = cnt = out
    _argmax_kernel[(R, C)](x, out, ws_v, ws_i, cnt, V, x.stride(0), C, BLOCK=block,
                           C_PAD=triton.next_power_of_2(C), SPLIT=C > 1, num_warps=8 if block >= 4096 else 4)
    return out
