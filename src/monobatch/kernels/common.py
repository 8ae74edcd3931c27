"""What the Triton kernels share: the optional Triton import and the per-device split counters.

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


def _wanted() -> bool:
    """Whether to import Triton (``MONOBATCH_TRITON``, see the module docstring)."""
    setting = os.environ.get("MONOBATCH_TRITON", "auto")
    if setting in ("0", "1"):
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


def require_triton(head_dim: int) -> None:
    """The attention kernels' precondition.

    Raises:
        RuntimeError: Triton is not installed, or ``head_dim`` is not a power of two (``tl.arange``).
    """
    if triton is None:
        raise RuntimeError("Triton is not installed")
    if head_dim & (head_dim - 1):
        raise RuntimeError(f"head_dim {head_dim} is not a power of two")
