"""Programmatic dependent launch (PDL) for the Triton kernels of the decode step.

At B=1 a decode step is ~150 small kernels; between two of them the GPU idles while the next
grid is launched and its first loads come back (~1-2 us each, a fifth of a llama-1b step on an
H200). With PDL (CUDA >= 11.8 on Hopper and later; kept by CUDA-graph stream capture as
programmatic edges) a kernel may start while the one before it is still running: it computes its
addresses and loads what no earlier kernel writes (weights) first, then waits at
``griddepcontrol.wait`` until the previous grid has finished and its memory is visible, and only
then reads or writes activations. Right after that wait it lets the next kernel start
(``griddepcontrol.launch_dependents``), so at most one grid is waiting ahead of the running one.
(NVIDIA CUDA programming guide, "Programmatic Dependent Launch"; TensorRT-LLM and FlashInfer use
it for the same reason.)

Rule for every kernel launched with PDL: nothing it reads that another kernel writes, and nothing
it writes, may be touched before :func:`wait_prior`; every program calls it (also programs that
then do nothing), so a grid completes only after the one before it.

``MONOBATCH_PDL=0`` turns it off (A/B runs; the kernels are then launched normally and the wait
compiles to nothing).
"""

from __future__ import annotations

import os

import torch

try:  # as monobatch.kernels.paged_decode (which imports this module)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None

ON = os.environ.get("MONOBATCH_PDL", "1") != "0"
_CAPABLE: dict[int, bool] = {}


def enabled(device: torch.device) -> bool:
    """True when kernels on ``device`` are launched with PDL: switched on, Triton present, a CUDA
    device of compute capability >= 9.0 (Hopper), not the Triton interpreter."""
    if not (ON and triton is not None and device.type == "cuda") or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _CAPABLE[index]


def launch(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch on ``device``: the kernel's ``PDL`` constexpr and
    Triton's ``launch_pdl`` option, both on or both off."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on}


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def wait_prior(PDL: tl.constexpr):
        # Wait for the previous grid (its writes visible), then let the next one launch.
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
