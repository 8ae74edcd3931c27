"""What the Triton kernels share: the optional Triton import, the per-device split counters and
the ``MONOBATCH_TRITON`` switch (the kernels' A/B settings: :func:`monobatch.env.fatal_integer`).

Every kernel module (:mod:`~monobatch.kernels.pdl`, :mod:`~monobatch.kernels.fused`,
:mod:`~monobatch.kernels.gemv`, :mod:`~monobatch.kernels.paged_decode`,
:mod:`~monobatch.kernels.argmax`) imports ``triton``/``tl`` and :func:`counters` from here, so
none of them imports another for these pieces (they used to import each other in a circle).

``triton`` and ``tl`` are None where Triton is not installed (CPU-only torch builds), and by
default on a machine without CUDA: Triton's runtime costs ~70 MB of resident memory at import and
no CPU path launches a Triton kernel. ``MONOBATCH_TRITON`` decides: ``auto`` (the default: import
it when CUDA is available or ``TRITON_INTERPRET=1``, which the interpreter tests set), ``1``
(always: the test suite, to compile the kernels for sm_90 on CPU) or ``0`` (never).
"""

from __future__ import annotations

import os

import torch

from monobatch import env


def _wanted() -> bool:
    """Whether to import Triton (``MONOBATCH_TRITON``, see the module docstring; any other value
    warns once and counts as ``auto``)."""
    setting = env.choice("MONOBATCH_TRITON", "auto", ("auto", "1", "0"))
    if setting != "auto":
        return setting == "1"
    return os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


triton = tl = None
if _wanted():
    try:  # Triton ships with CUDA builds of torch; CPU-only installs have none.
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover - depends on the install
        triton = tl = None


#: Split counters kept per device (int32 slots); a launch needing more gets fresh zeroed ones.
MAX_COUNTERS = 1 << 16
#: device -> the zeroed int32 counter buffer shared by every "last program reduces" kernel.
COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters ``[>= n]`` for a split kernel's "last program reduces" merge (the
    split-K GEMV, the paged decode's partitions, the argmax): the per-device buffer (made on first
    use outside a graph capture, never freed: graphs keep its address; every kernel leaves it
    zeroed), else a zeroed tensor per call (a captured memset). Assumes one stream at a time runs
    such kernels on a device."""
    buf = COUNTERS.get(device)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if buf is None and not capturing:
        buf = COUNTERS[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return buf if buf is not None and n <= MAX_COUNTERS else torch.zeros(n, dtype=torch.int32, device=device)


_SMS: dict[torch.device, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached; 16 off CUDA: the interpreter tests), for
    the grid-size rules of the split kernels."""
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16
    return _SMS[device]


def require_triton(head_dim: int) -> None:
    """The attention kernels' precondition.

    Raises:
        RuntimeError: Triton is not installed, or ``head_dim`` is not a power of two (``tl.arange``).
    """
    if triton is None:
        raise RuntimeError("Triton is not installed")
    if head_dim & (head_dim - 1):
        raise RuntimeError(f"head_dim {head_dim} is not a power of two")


if triton is not None:

    @triton.jit
    def grouped_tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
        """``(pid_m, pid_n)``: the output tile of GEMM program ``pid`` in the grouped launch order
        (GROUP_M row tiles in turn over each column tile, so neighbouring programs share W's tiles
        in L2; Triton's matmul tutorial)."""
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        group = GROUP_M * num_n
        first_m = (pid // group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (pid % group) % size_m, (pid % group) // size_m

    @triton.jit
    def split_k_store(acc, WS, CNT, B, Y, M, N, pid_n, pid_k, splits, offs_m, offs_n, mmask, nmask, stride_ym,
                      HAS_BIAS: tl.constexpr):
        """The split kernels' epilogue (the GEMVs, the batch-invariant GEMM's split-K): store
        ``acc`` (float32 ``[BLOCK_N, M_PAD]``, y^T's tile of columns ``offs_n`` and rows ``offs_m``;
        ``pid_n`` the tile's counter slot) to ``Y`` (+ bias). With ``splits`` > 1 K slices, each stores
        its partial to the workspace ``WS`` (``[splits, M, N]`` float32) and counts itself in
        ``CNT[pid_n]``; the last to arrive sums the slices in slice order (the same bits whichever
        finishes last), writes the tile and zeroes the counter for the next launch."""
        omask = nmask[:, None] & mmask[None, :]
        tile = offs_m[None, :] * N + offs_n[:, None]  # [BLOCK_N, M_PAD] offsets in an [M, N] slab
        done = pid_n >= 0  # (a true scalar tensor)
        if splits > 1:
            tl.store(WS + pid_k * M * N + tile, acc, mask=omask)
            tl.debug_barrier()  # every thread's partial is stored before the (releasing) count
            done = tl.atomic_add(CNT + pid_n, 1, sem="acq_rel") == splits - 1
            if done:  # the last slice of this tile: sum all slices in a fixed order
                acc = tl.zeros_like(acc)
                for s in range(0, splits):
                    acc += tl.load(WS + s * M * N + tile, mask=omask, other=0.0, cache_modifier=".cg")
                tl.store(CNT + pid_n, 0)
        if done:
            if HAS_BIAS:
                acc += tl.load(B + offs_n, mask=nmask, other=0.0).to(tl.float32)[:, None]
            tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(Y.dtype.element_ty), mask=omask)
