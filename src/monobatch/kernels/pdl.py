"""Programmatic dependent launch (PDL) for the Triton kernels of the decode step.

At B=1 a decode step is ~150 small kernels; between two of them the GPU idles while the next
grid is launched and its first loads come back (~1-2 us each, a tenth of a llama-1b step on an
H200). With PDL (Hopper and later; inside CUDA graphs it needs CUDA >= 12.3, whose stream capture
keeps the dependency as a programmatic edge) a kernel may start while the one before it is still
running: it computes its addresses and loads what no kernel writes (the GEMV's first weight
tile, a norm's weight) first, then waits at ``griddepcontrol.wait`` until the previous grid has
finished and its memory is visible, and only then reads or writes activations. Right after that
wait, or before it for the small kernels (:data:`TRIGGER`, below), it lets the next kernel start
(``griddepcontrol.launch_dependents``; the decode attention with
``MONOBATCH_DECODE_LATE_TRIGGER=1`` not at all: the next starts as its programs exit,
:func:`wait_only`). (NVIDIA CUDA programming guide, "Programmatic Dependent Launch";
TensorRT-LLM and FlashInfer use it for the same reason.)

Rule for every kernel launched with PDL: nothing it reads that another kernel writes, and nothing
it writes, may be touched before :func:`wait_prior`; every program calls it (also programs that
then do nothing), so a grid completes only after the one before it. One exception: the decode
attention (kernels/paged_decode.py) loads its first key and value tile before the wait, the
newest row included, which the kernel before it may be writing; it reads that row again after
the wait and uses it in the tile's place, so a value read early is never used. Kernels that do
not follow the rule (torch's, the argmax) are launched without PDL and so wait for the previous
kernel's end.

When a kernel lets the next one launch is ``MONOBATCH_PDL_TRIGGER``'s (:data:`TRIGGER`): ``small``
(the default: the small kernels between the projections, the norms, the RoPE and the SiLU, call it
before their wait, so the kernel after one of them, a GEMV or the attention, launches while the
kernel before it still runs and loads its weights, or its key tile, meanwhile; the others right
after their wait), ``wait`` (every kernel right after its wait) or ``all`` (every kernel before its
wait). Measured on the H200 (2026-12-06, llama-8b, random packed Q4_K weights, B=1, two rounds):
``small`` 368.1 / 368.2 tok/s, ``all`` 367.4 / 367.2, ``wait`` 363.8 / 364.1, the same tokens.
Safe either way: a kernel's wait is for the previous grid's completion, and that grid completed
only after its own wait, so everything before it is complete too (what a kernel touches before
its wait is never written by any kernel of the step, but the attention's newest row, above); a
grid launches only when every program of the one before it has started, so no grid waits on
programs that cannot be scheduled.

``MONOBATCH_PDL=0`` turns it off (A/B runs; the kernels are then launched normally and the wait
compiles to nothing). A Triton without ``gdc_wait`` (before 3.4) or an older CUDA driver turns
it off too. Where it is on, the GEMV takes its tiles from ``gemv.PDL_CONFIGS`` (measured with
PDL), so turning it off changes those layers' summation order, not only their timing.
"""

from __future__ import annotations

import os

import torch

from monobatch import env
from monobatch.kernels.common import tl, triton

ON = env.flag("MONOBATCH_PDL", True)
#: When a kernel lets the next one launch: "wait", "small" or "all" (the module docstring).
TRIGGER = env.choice("MONOBATCH_PDL_TRIGGER", "small", ("small", "wait", "all"))
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_CAPABLE: dict[int, bool] = {}

_gdc = None
if triton is not None:
    try:  # Triton >= 3.4 (griddepcontrol helpers and the launch_pdl option)
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
        _gdc = (gdc_wait, gdc_launch_dependents)
    except ImportError:  # pragma: no cover - depends on the install
        pass


def _cuda_at_least(major: int, minor: int) -> bool:
    """The CUDA driver is >= major.minor (stream capture keeps PDL edges from CUDA 12.3 on); where
    torch cannot tell the driver's version, the runtime torch was built for (a driver is never
    older than the runtime it runs)."""
    want = major * 1000 + minor * 10
    try:
        return int(torch._C._cuda_getDriverVersion()) >= want  # e.g. 12040 for 12.4
    except (AttributeError, RuntimeError, TypeError, ValueError):
        pass
    try:
        runtime = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    except ValueError:  # pragma: no cover - depends on the build
        return False
    return runtime >= (major, minor)


def enabled(device: torch.device) -> bool:
    """True when kernels on ``device`` are launched with PDL: switched on, a Triton with the
    griddepcontrol helpers, a CUDA device of compute capability >= 9.0 (Hopper), a CUDA >= 12.3
    driver, not the Triton interpreter."""
    if not (ON and _gdc is not None and device.type == "cuda") or _INTERPRETED:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9 and _cuda_at_least(12, 3)
    return _CAPABLE[index]


def launch(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch on ``device``: the kernel's ``PDL`` constexpr, and
    Triton's ``launch_pdl`` option when on (left out when off: older Tritons lack the option)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


if triton is not None:

    _EARLY_ALL = tl.constexpr(TRIGGER == "all")
    _EARLY_SMALL = tl.constexpr(TRIGGER in ("small", "all"))

    @triton.jit
    def _wait(PDL: tl.constexpr, EARLY: tl.constexpr):
        # Wait for the previous grid (its writes visible) and let the next one launch: after the
        # wait, or before it where EARLY. PDL is True only where enabled() found the helpers (the
        # names are resolved when this compiles).
        if PDL:
            if EARLY:
                gdc_launch_dependents()
                gdc_wait()
            else:
                gdc_wait()
                gdc_launch_dependents()

    @triton.jit
    def wait_prior(PDL: tl.constexpr):
        # every kernel's wait but the small ones' (TRIGGER "all": the next grid launched first)
        _wait(PDL, _EARLY_ALL)

    @triton.jit
    def wait_only(PDL: tl.constexpr):
        # the wait alone, no trigger: the next grid launches as this one's programs exit
        if PDL:
            gdc_wait()

    @triton.jit
    def wait_prior_small(PDL: tl.constexpr):
        # the norms', the RoPE's and the SiLU's wait (TRIGGER "small" or "all": the next grid launched first)
        _wait(PDL, _EARLY_SMALL)
