"""Helpers for the `monobatch run` / `chat` tests: the command as a subprocess or on a pty."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from server_util import ROOT

#: The --stats line: prompt and generated tokens, finish reason, TTFT, decode rate.
STATS_RE = re.compile(r"\[(\d+) prompt \+ (\d+) generated tokens, finish_reason=(\w+), TTFT (\d+) ms, "
                      r"decode ([\d.]+|-) tok/s\]")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]")


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a `python -m monobatch` child: this checkout, quiet tokenizers, no
    inherited API key."""
    env = {k: v for k, v in os.environ.items() if k != "MONOBATCH_API_KEY"}
    return {**env, "PYTHONPATH": str(ROOT / "src"), "TOKENIZERS_PARALLELISM": "false", **extra}


def monobatch(*args: str, stdin: str | None = None, env: dict | None = None,
              timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``python -m monobatch ARGS`` to the end, output captured (stdin: the text, or none)."""
    return subprocess.run([sys.executable, "-m", "monobatch", *args], input=stdin if stdin is not None else "",
                          capture_output=True, text=True, timeout=timeout, env=env or cli_env())


def assert_one_line_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    """A failure exit with exactly one line on stderr (holding every needle), no traceback, no stdout."""
    assert res.returncode != 0, res
    assert "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert res.stdout == ""


def clean(tty_text: str) -> str:
    """Terminal output as plain text: escape sequences dropped, CR LF as LF."""
    return _ANSI.sub("", tty_text).replace("\r\n", "\n")
