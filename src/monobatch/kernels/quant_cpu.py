"""The packed-weight CPU matmuls (``csrc/quant_cpu.cpp``), compiled on this machine, with the
fused decode-step ops of :mod:`monobatch.kernels.cpu_ops` (``csrc/cpu_ops.cpp``) in the same module.

The C++ sources are built once with torch's extension builder (g++, ``-O3 -march=native``, OpenMP
through torch's own runtime, so ``torch.set_num_threads`` / ``-t`` governs it) into
``$MONOBATCH_KERNEL_CACHE`` (default ``~/.cache/monobatch/kernels``); ``make run`` builds it at
install (``python -m monobatch.kernels.quant_cpu``), and a later run loads the cached module (a
changed source is rebuilt; so is a changed ``csrc/simd.h``: ninja records the headers each object
includes, and every new process runs it). Nothing prebuilt is fetched. Where no compiler is found the loader
falls back to dequantized weights and says so (:func:`available`).

Layouts and numerics: see the C++ file's header and :mod:`monobatch.quant.formats`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from monobatch import env

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "quant_cpu.cpp"
#: every source of the extension: the packed matmuls and the fused decode-step ops (:mod:`monobatch.kernels.cpu_ops`)
SOURCES = (SOURCE, Path(__file__).parent / "csrc" / "cpu_ops.cpp")
#: Headers the sources include (a change rebuilds: ninja tracks them; the start-up message checks them too).
HEADERS = tuple(Path(__file__).parent / "csrc" / h for h in ("packed.h", "simd.h"))
NAME = "monobatch_quant_cpu"


#: The kernel cache without ``$MONOBATCH_KERNEL_CACHE`` (or where it names a folder that cannot be used).
DEFAULT_CACHE = Path.home() / ".cache" / "monobatch" / "kernels"


def cache_dir(root: str | Path | None = None) -> Path:
    """Where the compiled module lives: ``root`` (default ``$MONOBATCH_KERNEL_CACHE``, or
    :data:`DEFAULT_CACHE`) / ``torch-<version>-<hash of this package's folder>``. One build folder
    per installed copy: ninja's build file names the source paths, so two checkouts sharing a
    folder would rebuild each other's module on every start. The folders of copies since deleted
    are removed, once unused for :data:`STALE_DAYS` days, when the module loads (:func:`prune_stale`)."""
    root = root or env.text("MONOBATCH_KERNEL_CACHE") or DEFAULT_CACHE
    where = hashlib.sha1(str(Path(__file__).resolve().parent).encode()).hexdigest()[:10]
    return Path(root) / f"torch-{torch.__version__}-{where}"


#: Days a build folder of a deleted copy is kept after its last load (:func:`prune_stale`): a
#: cache shared between hosts or containers (an NFS home, a mounted ``~/.cache``) holds copies
#: that exist on another side; used there within this time, their folders stay.
STALE_DAYS = 14


def prune_stale(build: Path, now: float | None = None) -> list[Path]:
    """Remove the build folders beside ``build`` (``torch-*``) of copies of the package that are
    gone: their ``build.ninja`` compiles a ``quant_cpu.cpp`` that no longer exists (a deleted
    checkout or venv; each copy has its own folder, ~2 MB), and the folder has not been loaded
    for :data:`STALE_DAYS` days (its modification time, which every load updates). Any other
    folder is kept; any error (a folder or source path this user cannot read, an unreadable build
    file, another process pruning too) keeps the folder.

    Args:
        build: this copy's build folder (:func:`cache_dir`).
        now: the time to age folders against, seconds since the epoch (default: now).

    Returns:
        The folders removed.
    """
    cutoff = (time.time() if now is None else now) - STALE_DAYS * 86400
    gone = []
    for other in build.parent.glob("torch-*"):
        try:
            if other == build or other.stat().st_mtime > cutoff:
                continue
            lines = (other / "build.ninja").read_text(errors="replace").splitlines()
            # ninja escapes a space, a colon and "$" with a "$" before them (a path with a space)
            sources = [re.sub(r"\$(.)", r"\1", ln.split(": compile ", 1)[1].strip()) for ln in lines
                       if ln.startswith(f"build {SOURCE.stem}.o: compile ")]
            if not sources:
                continue
            try:
                os.lstat(sources[0])
                continue  # the copy exists
            except (FileNotFoundError, NotADirectoryError):
                pass  # gone (a path this user may not read raises PermissionError: kept, below)
            shutil.rmtree(other, ignore_errors=True)
        except (OSError, ValueError):
            continue
        if not other.exists():
            gone.append(other)
    return gone


def _usable(build: Path) -> None:
    """Create the build folder ``build``; OSError when it cannot be created or written (ninja
    writes its log there on every load)."""
    build.mkdir(parents=True, exist_ok=True)
    if not os.access(build, os.W_OK | os.X_OK):
        raise PermissionError(f"{build} is not writable")


@functools.cache
def module() -> ModuleType:
    """The compiled extension (built on first use when not cached; tens of seconds once).

    Raises:
        RuntimeError: the build failed (no compiler, no ninja, ...).
    """
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the `ninja` package's binary, when the venv's bin is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    build = cache_dir()
    try:
        _usable(build)
    except OSError as e:
        if not env.text("MONOBATCH_KERNEL_CACHE"):
            raise
        # the variable's folder cannot hold the build: say so by name, and use the default's
        env.warn("MONOBATCH_KERNEL_CACHE", os.environ["MONOBATCH_KERNEL_CACHE"], f"is not a usable folder ({e})",
                 DEFAULT_CACHE)
        build = cache_dir(DEFAULT_CACHE)
        _usable(build)
    built = build / f"{NAME}.so"
    if not built.exists() or any(p.stat().st_mtime > built.stat().st_mtime for p in SOURCES + HEADERS):
        # a build takes a minute or two on a small machine: say so, or the first command looks hung
        print(f"monobatch: compiling the packed CPU kernels for this machine into {build} (once, about a minute)...",
              file=sys.stderr, flush=True)
    mod = cpp_extension.load(
        name=NAME, sources=[str(p) for p in SOURCES], build_directory=str(build),
        extra_cflags=["-O3", "-march=native", "-fopenmp"], verbose=False)
    try:
        os.utime(build)  # this folder's last load (torch's build lock touches it too): prune_stale ages by it
        gone = prune_stale(build)
    except Exception as e:  # never a reason to lose the kernels just built
        log.debug("kernel cache not pruned (%s)", e)
    else:
        if gone:
            log.info("removed %d kernel build folder(s) of deleted copies of monobatch from %s", len(gone),
                     build.parent)
    # A/B runs: least multiply-adds per thread (None: the C++ default)
    work = env.number("MONOBATCH_CPU_MIN_THREAD_WORK", None, parse=int, what="a positive integer", shown="the default")
    if work is not None:
        mod.set_min_thread_work(work)
    return mod


@functools.cache
def available() -> bool:
    """Whether the kernels load (built now if needed); logs once why not."""
    try:
        module()
        return True
    except Exception as e:  # a compiler or ninja missing: the packed path is then unavailable
        log.warning("packed CPU kernels unavailable (%s); weights are dequantized at load", str(e).splitlines()[0])
        return False


def gemm(x: torch.Tensor, qs: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group: int,
         q4: bool) -> torch.Tensor:
    """``x @ W.T`` for packed ``W`` ``[N, K]``: x float32 ``[M, K]`` -> float32 ``[M, N]`` (few rows),
    by the int16-activation GEMV: each x row rounded to int16 per group of ``group`` columns
    (``sx = amax / 32767``), exact integer group dots, float32 sums; each output moves by at most
    ``sum_j |scale q_j| amax_g / 65534`` (plus float32 rounding) from the float product
    (``csrc/quant_cpu.cpp``'s header; ADR 0006, "int16 activations"). Rows are independent of M
    and of each other; a row holding NaN or Inf gives non-finite outputs.

    Args:
        qs: uint8 ``[N, K/2]`` (``q4``) or int8 ``[N, K]``.
        scale, minimum: float32 ``[N, K/group]``, or both float16 (widened exactly in the kernel).

    Raises:
        RuntimeError: mis-shaped or mistyped packed tensors (2-D, one scale row per weight row,
            ``K/group`` scales a row, contiguous), checked before any read.
    """
    return module().gemm(x, qs, scale, minimum, group, q4)


def dequant(qs: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group: int, q4: bool,
            out: torch.Tensor) -> torch.Tensor:
    """Packed rows as float32 into ``out`` ``[N, K]`` (contiguous); returns ``out``. ``qs``,
    ``scale`` and ``minimum`` as :func:`gemm` takes them (float16 scales widened exactly).

    Raises:
        RuntimeError: mis-shaped or mistyped packed tensors (as :func:`gemm`)."""
    module().dequant(qs, scale, minimum, group, q4, out)
    return out


if __name__ == "__main__":  # `make run` builds the kernels here, once
    logging.basicConfig(level=logging.INFO)
    print(f"packed CPU kernels: {'built' if available() else 'NOT available'} in {cache_dir()}")
