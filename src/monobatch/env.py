"""Reading the ``MONOBATCH_*`` environment knobs (docs/cli.md, "Environment variables").

Every tuning knob is read through one of these functions, so a bad value is handled the same way
everywhere (unset or empty is the default, silently). Two are not knobs of this kind:
``MONOBATCH_API_KEY`` (a secret the CLI checks as it checks ``--api-key``) and
``MONOBATCH_PACKED_GEMV_CONFIGS`` (a file path, where empty means "no table", not the default;
:func:`monobatch.kernels.quant_gemm.tuned_configs`, warning through :func:`warn`).

- :func:`flag`, :func:`choice`, :func:`number`: a value that is not what the knob takes is named
  in one line on stderr, ``monobatch: warning: NAME='value' is not ...: using DEFAULT``, once per
  process and variable, and the default is used.
- :func:`fatal_integer` and :class:`SettingError`: the kernels' tile and split settings, whose
  docs say a malformed value stops the command (an A/B run must not measure something else than
  asked). :class:`SettingError` is a :class:`SystemExit` (outside the CLI: exit code 1, the line
  on stderr); the CLI prints it as its other errors, ``monobatch COMMAND: error: ...``.
- :data:`KNOWN_NAMES`, the one registry of the variables monobatch reads, and
  :func:`warn_unknown_names`: any other ``MONOBATCH_*`` variable in the environment (a typo, a
  removed knob) is named in one line on stderr, once per process, with the closest known name.

Warnings are printed, not logged: most knobs are read at import, before any logging is set up.
A tensor-parallel worker rank (a process of :mod:`monobatch.distributed.runtime`, named
``monobatch-tp<rank>``) re-imports the modules that read them; it stays quiet, as the engine's
own process has already warned.
"""

from __future__ import annotations

import difflib
import multiprocessing
import os
import sys
from typing import Any, Callable, Mapping, Sequence, TypeVar

T = TypeVar("T")

#: The name prefix of a tensor-parallel worker process (:class:`~monobatch.distributed.runtime.TensorParallelDriver`).
WORKER_PREFIX = "monobatch-tp"
#: Variables already warned about in this process.
_WARNED: set[str] = set()
#: What every variable of monobatch's starts with.
PREFIX = "MONOBATCH_"
#: Every ``MONOBATCH_*`` variable monobatch reads (docs/cli.md, "Environment variables"): the one
#: registry, so that any other name in the environment can be called a typo
#: (:func:`warn_unknown_names`). tests/test_env.py checks that each ``MONOBATCH_*`` name written in
#: src/ or scripts/ is listed here, and that each listed name is read somewhere and documented.
KNOWN_NAMES = frozenset({
    "MONOBATCH_API_KEY",
    "MONOBATCH_CPU_KERNELS",
    "MONOBATCH_CPU_MIN_THREAD_WORK",
    "MONOBATCH_DECODE_BLOCK_N",
    "MONOBATCH_DECODE_LATE_TRIGGER",
    "MONOBATCH_DECODE_MIN_PART",
    "MONOBATCH_DECODE_SPLITS",
    "MONOBATCH_DECODE_STAGES",
    "MONOBATCH_DECODE_WARPS",
    "MONOBATCH_DET_GLU",
    "MONOBATCH_DET_SPLIT",
    "MONOBATCH_FORCED_DRAWS",
    "MONOBATCH_FUSED_KERNELS",
    "MONOBATCH_KERNEL_CACHE",
    "MONOBATCH_PACKED_DEQUANT_M",
    "MONOBATCH_PACKED_GEMV",
    "MONOBATCH_PACKED_GEMV_CONFIGS",
    "MONOBATCH_PACKED_GEMV_PAIR",
    "MONOBATCH_PDL",
    "MONOBATCH_PDL_TRIGGER",
    "MONOBATCH_TP_TIMEOUT",
    "MONOBATCH_TRITON",
    "MONOBATCH_TRITON_ARGMAX",
    "MONOBATCH_TRITON_GEMV",
    "MONOBATCH_VARLEN_BLOCK_N",
    "MONOBATCH_VARLEN_STAGES",
    "MONOBATCH_VARLEN_WARPS",
})
#: How close (difflib's ratio, on the part after the prefix) a known name must be to be suggested:
#: a letter missing, doubled or swapped, a missing underscore.
_CLOSE = 0.75


class SettingError(SystemExit):
    """A knob documented as fatal has a malformed value: the message names it (one line). A
    :class:`SystemExit`, so an ``except Exception`` on the way (an optional import, a fallback
    path) never swallows it; the CLI catches it and prints it with its error prefix."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def text(name: str) -> str | None:
    """The raw value of ``name``; None when unset or empty (both mean the default)."""
    value = os.environ.get(name)
    return value if value else None


def warn(name: str, value: str, problem: str, using: Any) -> None:
    """Print ``monobatch: warning: NAME='value' PROBLEM: using USING`` on stderr, once per process
    and variable (a module read twice, a function called per model, say it once); nothing in a
    tensor-parallel worker rank."""
    _warn_once(name, f"{name}={value!r} {problem}: using {using}")


def warn_unknown_names(environ: Mapping[str, str] | None = None) -> None:
    """Name each ``MONOBATCH_*`` variable of ``environ`` (default: this process's environment)
    that is not in :data:`KNOWN_NAMES` in one line on stderr, ``monobatch: warning: unknown
    environment variable NAME (did you mean KNOWN?)`` (the hint where a known name is close: a
    letter missing, doubled or swapped), once per process and name; nothing in a tensor-parallel
    worker rank. Only a warning: the variable stays ignored. The prefix is matched in any case
    (``monobatch_pdl`` is named too, with ``MONOBATCH_PDL`` as the hint); the value is never
    printed (a misspelt API key's name would show the key).

    Called where the doors start: the CLI's ``main`` (every command, those that load no model too)
    and :func:`monobatch.loader.resolve_device` (every model built: the Python API, scripts).
    """
    environ = os.environ if environ is None else environ
    suffixes = {name[len(PREFIX):]: name for name in KNOWN_NAMES}
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(PREFIX) or name in KNOWN_NAMES:
            continue
        close = difflib.get_close_matches(upper[len(PREFIX):], suffixes, n=1, cutoff=_CLOSE)
        hint = f" (did you mean {suffixes[close[0]]}?)" if close else ""
        _warn_once(name, f"unknown environment variable {name}{hint}")


def _warn_once(key: str, message: str) -> None:
    """``monobatch: warning: MESSAGE`` on stderr, the first time ``key`` is warned about in this
    process; never in a tensor-parallel worker rank (the engine's own process has said it)."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    if multiprocessing.current_process().name.startswith(WORKER_PREFIX):  # named before it imports anything
        return
    print(f"monobatch: warning: {message}", file=sys.stderr, flush=True)


def flag(name: str, default: bool) -> bool:
    """An on/off knob: ``"1"`` on, ``"0"`` off; unset or empty: ``default``; anything else warns
    (``NAME='v' is not 0 or 1: using 1``) and gives ``default``."""
    value = text(name)
    if value in ("0", "1"):
        return value == "1"
    if value is not None:
        warn(name, value, "is not 0 or 1", int(default))
    return default


def choice(name: str, default: str, options: Sequence[str]) -> str:
    """A knob taking one of ``options`` (exact strings); unset or empty: ``default``; anything else
    warns (``NAME='v' is not one of a, b, c: using DEFAULT``) and gives ``default``."""
    value = text(name)
    if value is None or value in options:
        return value or default
    warn(name, value, f"is not one of {', '.join(options)}", default)
    return default


def number(name: str, default: T, parse: Callable[[str], Any] = float,
           check: Callable[[Any], bool] = lambda v: v > 0, what: str = "a positive number",
           shown: str | None = None) -> T | Any:
    """A numeric knob: ``parse(value)`` where ``check`` accepts it; unset or empty: ``default``; a
    value ``parse`` refuses (ValueError, OverflowError) or ``check`` rejects warns
    (``NAME='v' is not WHAT: using DEFAULT``, ``shown`` in place of the default's text when given)
    and gives ``default``."""
    value = text(name)
    if value is None:
        return default
    try:
        parsed = parse(value.strip())
        if check(parsed):
            return parsed
    except (ValueError, OverflowError):
        pass
    warn(name, value, f"is not {what}", default if shown is None else shown)
    return default


def fatal_integer(name: str, default: int, *, minimum: int = 1, maximum: int | None = None,
                  power_of_two: bool = False) -> int:
    """The integer in ``name`` (``default`` when unset or empty): a kernel's tuning knob for A/B runs,
    read once at import, at least ``minimum``, at most ``maximum`` and, with ``power_of_two``, a
    power of two (a tile size, a warp count).

    Raises:
        SettingError: the value is not such an integer (a start-up error, one line naming it).
    """
    value = text(name)
    if value is None:
        return default
    try:
        parsed = int(value)
    except ValueError:
        parsed = None
    if parsed is None or parsed < minimum or (maximum is not None and parsed > maximum) \
            or (power_of_two and parsed & (parsed - 1)):
        what = ("a power of two" if power_of_two else "an integer") + f" >= {minimum}" \
            + (f" and <= {maximum}" if maximum is not None else "")
        raise SettingError(f"{name}={value!r}: expected {what}")
    return parsed
