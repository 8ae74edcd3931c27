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

Warnings are printed, not logged: most knobs are read at import, before any logging is set up.
A tensor-parallel worker rank (a process of :mod:`monobatch.distributed.runtime`, named
``monobatch-tp<rank>``) re-imports the modules that read them; it stays quiet, as the engine's
own process has already warned.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")

#: The name prefix of a tensor-parallel worker process (:class:`~monobatch.distributed.runtime.TensorParallelDriver`).
WORKER_PREFIX = "monobatch-tp"
#: Variables already warned about in this process.
_WARNED: set[str] = set()


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
    if name in _WARNED:
        return
    _WARNED.add(name)
    if multiprocessing.current_process().name.startswith(WORKER_PREFIX):  # named before it imports anything
        return
    print(f"monobatch: warning: {name}={value!r} {problem}: using {using}", file=sys.stderr, flush=True)


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
