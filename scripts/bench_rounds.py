"""Benchmark arms in interleaved rounds, so host noise cancels out: compare configurations as ratios.

An *arm* is a name and a command line that prints JSON on stdout: one JSON object per line per
measured configuration (``monobatch bench --json``, ``monobatch bench-serve --json``, or any
program). Each object's string ``"label"`` (``""`` when absent) names the configuration; every
numeric top-level field is a metric, keyed by (arm, label, metric). Commands starting with
``monobatch`` run as ``sys.executable -m monobatch ...``; every command has this checkout's
``src`` on PYTHONPATH, after the arm's own PYTHONPATH if it sets one (``PYTHONPATH=../old/src
monobatch bench ...`` runs another checkout). Leading ``NAME=value`` words set environment
variables (``CUDA_VISIBLE_DEVICES=1 monobatch bench ...``). Commands are split with shlex and run without a shell.

Examples::

    # paged vs dense KV storage on one GPU, 5 rounds (default), table on stdout, everything in JSON
    .venv/bin/python scripts/bench_rounds.py \\
        --arm paged='monobatch bench --dummy-weights --shape llama-1b --device cuda --kv-storage paged --json' \\
        --arm dense='monobatch bench --dummy-weights --shape llama-1b --device cuda --kv-storage dense --json' \\
        --json rounds.json

    # later: the same arms against that file; exit 1 when a median got worse beyond the noise floor
    .venv/bin/python scripts/bench_rounds.py --arm paged='...' --arm dense='...' --baseline rounds.json

    # only some metrics in the table and the comparison (fnmatch patterns)
    .venv/bin/python scripts/bench_rounds.py --arm a='monobatch bench -p 64 -n 32 --json' \\
        --metrics 'decode_tok_s,ttft_ms' --rounds 7

    # a serving benchmark against a running server as an arm
    .venv/bin/python scripts/bench_rounds.py --allow-busy \\
        --arm serve='monobatch bench-serve --base-url http://127.0.0.1:8080 --num-prompts 64 --json'

Rounds: each round runs every arm once; round r (0-based) starts at arm r mod k and goes round
the list, so each arm takes each position equally often over k rounds (k counts the null arm).
The **null arm** is the first arm run a second time under the name ``null`` (an A/A comparison):
its spread and its ratio to the first arm (ideally 1.00) show the noise floor of this host.
(``--no-null`` drops it.)

Runs: each run has ``--timeout`` seconds (default 600; its whole process group is killed after).
A run that times out, exits non-zero or prints no JSON is recorded and reported, not fatal;
only an arm whose every run failed is fatal (exit 4, after the report).

Quiet-host gate, before the first round and between rounds (on Linux and with nvidia-smi):

- CPU: busy when min(1-minute load average, tasks runnable right now) exceeds ``--max-load``
  (per core, default 0.5) x the core count. "Runnable right now" is the median over 1 s of
  /proc/loadavg's running count (this script excluded): the load average lags, and between
  rounds it still holds the arm that just ran.
- GPU (when ``nvidia-smi`` works): busy when a GPU's utilization exceeds ``--max-gpu-util``
  (default 10 %) or another process holds a compute context (``--query-compute-apps``).
  ``CUDA_VISIBLE_DEVICES`` (numeric) limits which GPUs count.

A busy host before the start is refused (exit 3, one line) unless ``--allow-busy``, which runs
anyway and flags the report ``busy``. Between rounds the gate waits up to ``--settle`` seconds
(default 30; ``--settle 0`` = no wait) for quiet; still busy: without ``--allow-busy`` the rounds
stop there (the report covers the rounds done, exit 3), with it the round is flagged busy.
``--max-load -1`` always counts the host as busy (for testing the gate).

Report (stdout): per (label, metric, arm) the median, min, max, spread = (max - min) / median %,
n, and the ratio of the median to the first arm's; the null arm's spread and ratio. Metrics that
are the same number in every run of every arm (settings such as ``prompt_tokens``) are listed
once instead. ``--json FILE`` writes everything: raw samples per run, the exact argv and env of
each arm, the host (cpu count, load, GPU names from nvidia-smi, platform, git commit), the date,
gate checks and the statistics.

``--baseline FILE`` (an earlier ``--json``): for each (arm, label, metric) in both (the null arm
aside), a **regression** is a median worse than the baseline's by more than the null arm's
spread for that (label, metric) + 1 %. Worse is higher for metrics whose names end in ``_ms`` or
``_s`` (not ``tok_s``) — times —, in ``_mib`` or ``_mb`` — memory, ``peak_rss_mib`` (``peak_rss_mb``
in files written before bench reported MiB) — and for ``failed`` and
``errors``; lower for the rest (rates, speedups). Any regression: exit 1.

Exit codes: 0 ok, 1 a regression against --baseline, 2 bad flags, 3 busy host, 4 an arm failed
in every run, 130 Ctrl-C (the report and --json still cover the runs done).

Pure standard library; run it with any Python 3.10+.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NULL_ARM = "null"
_ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


# -- arms and runs -----------------------------------------------------------------------------------

@dataclass
class Arm:
    """One configuration: a name, the argv to run and extra environment variables."""

    name: str
    command: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def parse_arm(spec: str) -> Arm:
    """``NAME=COMMAND`` -> Arm (``monobatch ...`` becomes ``python -m monobatch ...``).

    Raises:
        ValueError: no name, no command, or a command shlex cannot split.
    """
    name, sep, command = spec.partition("=")
    name = name.strip()
    if not sep or not name or not command.strip():
        raise ValueError(f"--arm needs NAME=COMMAND, got {spec!r}")
    if name == NULL_ARM:
        raise ValueError(f"--arm: the name {NULL_ARM!r} is the null arm's (the first arm run again)")
    words = shlex.split(command)
    env = {}
    while words and _ENV_WORD.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if not words:
        raise ValueError(f"--arm {name}: no command after the environment variables")
    if words[0] == "monobatch":
        words = [sys.executable, "-m", "monobatch", *words[1:]]
    return Arm(name, command.strip(), words, env)


@dataclass
class Run:
    """One run of one arm in one round (both counted from 1)."""

    round: int
    position: int
    arm: str
    status: str = ""  # ok | failed | timeout
    returncode: int | None = None
    seconds: float = 0.0
    error: str = ""
    results: list[dict[str, Any]] = field(default_factory=list)  # [{"label": str, "metrics": {name: value}}]
    busy: bool = False


def parse_output(stdout: str) -> list[dict[str, Any]]:
    """The JSON objects on stdout as ``[{"label", "metrics"}]``: one per line that holds one (or
    the whole output as one pretty-printed object). Numeric top-level fields (not booleans, not
    NaN) are metrics; a repeated label gets ``#2``, ``#3``."""
    objects = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                objects.append(obj)
    if not objects:
        try:
            obj = json.loads(stdout)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            objects.append(obj)
    out, seen = [], {}
    for obj in objects:
        label = obj.get("label", "")
        label = label if isinstance(label, str) else json.dumps(label)
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            label = f"{label}#{seen[label]}"
        metrics = {k: v for k, v in obj.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        out.append({"label": label, "metrics": metrics})
    return out


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def arm_env(arm: Arm) -> dict[str, str]:
    """The environment ``arm`` runs in: this one, the arm's variables, and PYTHONPATH = the arm's
    own PYTHONPATH (if it sets one), then this checkout's ``src``, then the inherited PYTHONPATH —
    so ``PYTHONPATH=/other/checkout/src monobatch bench ...`` runs that checkout's code (A/B of
    two versions)."""
    env = {**os.environ, **arm.env}
    paths = (arm.env.get("PYTHONPATH", ""), str(ROOT / "src"), os.environ.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def run_arm(arm: Arm, timeout: float, round_: int, position: int) -> Run:
    """Run ``arm`` once in its own process group; never raises for the command's failures."""
    run = Run(round_, position, arm.name)
    env = arm_env(arm)
    start = time.perf_counter()
    try:
        proc = subprocess.Popen(arm.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                text=True, env=env, start_new_session=True)
    except OSError as exc:
        run.status, run.error = "failed", f"cannot start {arm.argv[0]!r}: {exc.strerror or exc}"
        return run
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        stdout, stderr = proc.communicate()
        run.seconds = round(time.perf_counter() - start, 3)
        run.status, run.returncode = "timeout", proc.returncode
        run.error = f"timed out after {timeout:g} s"
        return run
    except BaseException:  # Ctrl-C: do not leave the arm running
        _kill_group(proc)
        proc.wait()
        raise
    run.seconds = round(time.perf_counter() - start, 3)
    run.returncode = proc.returncode
    if proc.returncode != 0:
        run.status = "failed"
        run.error = f"exit code {proc.returncode}: {_last_line(stderr) or _last_line(stdout) or 'no output'}"
        return run
    run.results = parse_output(stdout)
    if not run.results:
        run.status, run.error = "failed", f"no JSON object on stdout: {_last_line(stdout) or 'empty'}"
        return run
    run.status = "ok"
    return run


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (the command and whatever it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def schedule(arms: list[str], rounds: int) -> list[list[str]]:
    """The order of each round: round r starts at arm r mod k."""
    k = len(arms)
    return [arms[r % k:] + arms[:r % k] for r in range(rounds)]


# -- the quiet-host gate ---------------------------------------------------------------------------

def _runnable_now(samples: int = 10, interval: float = 0.1) -> float | None:
    """Median over ``samples`` of /proc/loadavg's running task count, this process excluded
    (None where there is no /proc/loadavg)."""
    counts = []
    for i in range(samples):
        try:
            field4 = Path("/proc/loadavg").read_text().split()[3]
        except (OSError, IndexError):
            return None
        counts.append(max(0, int(field4.split("/")[0]) - 1))
        if i + 1 < samples:
            time.sleep(interval)
    return statistics.median(counts)


def _nvidia_smi(*args: str) -> list[str] | None:
    """nvidia-smi's CSV lines (None when it is missing or fails)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    ids = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    select = ["-i", ids] if re.fullmatch(r"\d+(,\d+)*", ids) else []
    try:
        out = subprocess.run([exe, *args, *select, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]


def host_check(max_load: float, max_gpu_util: float) -> dict[str, Any]:
    """One look at the host: ``{"busy": bool, "reasons": [...], "load": ..., "gpus": ...}``."""
    cores = os.cpu_count() or 1
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    runnable = _runnable_now()
    known = [x for x in (load1, runnable) if x is not None]
    cpu_busy = min(known) if known else 0.0
    reasons = []
    if cpu_busy > max_load * cores:
        reasons.append(f"CPU: load average {load1:.2f}, {runnable if runnable is not None else '?'} runnable now, "
                       f"over {max_load:g} x {cores} cores")
    check: dict[str, Any] = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cores": cores,
                             "load_avg_1m": load1, "runnable_now": runnable}
    gpus = _nvidia_smi("--query-gpu=index,utilization.gpu,memory.used")
    if gpus is not None:
        check["gpus"] = []
        for line in gpus:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) < 3:
                continue
            util = _number(parts[1])
            check["gpus"].append({"index": parts[0], "utilization_pct": util, "memory_used_mib": _number(parts[2])})
            if util is not None and util > max_gpu_util:
                reasons.append(f"GPU {parts[0]}: {util:g} % utilized (over {max_gpu_util:g} %)")
        apps = _nvidia_smi("--query-compute-apps=pid,process_name,used_memory")
        if apps:
            apps = [a for a in apps if a.split(",")[0].strip() != str(os.getpid())]
            check["compute_apps"] = apps
            if apps:
                reasons.append(f"GPU: {len(apps)} other process(es) hold a compute context: {apps[0]}")
    check["busy"], check["reasons"] = bool(reasons), reasons
    return check


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def wait_quiet(max_load: float, max_gpu_util: float, settle: float) -> dict[str, Any]:
    """:func:`host_check` until quiet or ``settle`` seconds have passed; the last check."""
    deadline = time.monotonic() + settle
    while True:
        check = host_check(max_load, max_gpu_util)
        if not check["busy"] or time.monotonic() >= deadline:
            return check
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))


def host_info() -> dict[str, Any]:
    """What the report says about the machine."""
    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version(), "hostname": platform.node(),
                            "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    gpus = _nvidia_smi("--query-gpu=index,name,memory.total,driver_version")
    info["gpus"] = gpus if gpus is not None else []
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
        info["git_commit"] = commit + ("-dirty" if dirty else "") if commit else None
    except (OSError, subprocess.TimeoutExpired):
        info["git_commit"] = None
    return info


# -- statistics ------------------------------------------------------------------------------------------

#: Metrics that are better lower whatever their names end in: bench-serve's failed requests.
LOWER_IS_BETTER_NAMES = ("failed", "errors")
#: Name endings of metrics that are better lower: times (ms, s) and memory (MiB; ``_mb`` in older files).
LOWER_IS_BETTER_SUFFIXES = ("_ms", "_s", "_mib", "_mb")


def lower_is_better(metric: str) -> bool:
    """Times (``*_ms``, ``*_s`` but not the rates ``*tok_s``), memory (``*_mib``: ``peak_rss_mib``;
    ``*_mb`` in older files) and failures (``failed``, ``errors``) are better lower; everything
    else (rates, speedups, completed requests) higher."""
    if metric in LOWER_IS_BETTER_NAMES:
        return True
    return metric.endswith(LOWER_IS_BETTER_SUFFIXES) and not metric.endswith("tok_s")


def summarize(runs: list[Run], arm_names: list[str], patterns: list[str] | None) -> tuple[list[dict], dict]:
    """Per (arm, label, metric): median, min, max, spread %, n, ratio to the first arm's median.

    Returns:
        (stats rows, constants): constants (``label:metric`` -> value) are the metrics with one
        value in every run that has them (settings such as ``prompt_tokens``); their rows are
        marked ``constant`` and left out of the table.
    """
    samples: dict[tuple[str, str, str], list[float]] = {}
    for run in runs:
        for result in run.results:
            for metric, value in result["metrics"].items():
                if patterns and not any(fnmatch.fnmatchcase(metric, p) for p in patterns):
                    continue
                samples.setdefault((run.arm, result["label"], metric), []).append(value)
    by_key: dict[tuple[str, str], dict[str, list[float]]] = {}
    for (arm, label, metric), values in samples.items():
        by_key.setdefault((label, metric), {})[arm] = values
    labels = list(dict.fromkeys(label for label, _ in by_key))  # the order the arms print them in
    rows, constants = [], {}
    order = {name: i for i, name in enumerate(arm_names)}
    for (label, metric) in sorted(by_key, key=lambda k: labels.index(k[0])):
        arms = by_key[(label, metric)]
        values = {v for vs in arms.values() for v in vs}
        constant = len(values) == 1
        if constant:
            constants[f"{label}:{metric}" if label else metric] = next(iter(values))
        first = arms.get(arm_names[0])
        first_median = statistics.median(first) if first else None
        for arm in sorted(arms, key=lambda a: order.get(a, len(order))):
            vs = arms[arm]
            med = statistics.median(vs)
            rows.append({
                "arm": arm, "label": label, "metric": metric, "median": med, "min": min(vs), "max": max(vs),
                "spread_pct": (max(vs) - min(vs)) / abs(med) * 100 if med else None, "n": len(vs),
                "ratio": med / first_median if first_median else None,
                "lower_is_better": lower_is_better(metric), "constant": constant,
            })
    return rows, constants


def null_summary(rows: list[dict]) -> dict[str, Any] | None:
    """The noise floor: the null arm's largest spread and its ratios to the first arm."""
    nulls = [r for r in rows if r["arm"] == NULL_ARM and not r["constant"]]
    if not nulls:
        return None
    spreads = [r["spread_pct"] for r in nulls if r["spread_pct"] is not None]
    ratios = [r["ratio"] for r in nulls if r["ratio"] is not None]
    return {"max_spread_pct": max(spreads) if spreads else None,
            "median_spread_pct": statistics.median(spreads) if spreads else None,
            "ratio_min": min(ratios) if ratios else None, "ratio_max": max(ratios) if ratios else None,
            "max_abs_ratio_dev_pct": max(abs(r - 1) for r in ratios) * 100 if ratios else None}


def compare(rows: list[dict], baseline: dict[str, Any]) -> list[dict]:
    """Each (arm, label, metric) of ``rows`` (null arm aside) also in ``baseline``'s stats: the
    change and whether it is a regression (worse by more than the null arm's spread + 1 %). A
    baseline median of 0 (bench-serve's ``failed`` in a clean run) is measured against 1, so
    0 -> 3 failed requests is a change of +300 %."""
    base = {(r["arm"], r["label"], r["metric"]): r for r in baseline.get("stats", [])}
    null_spread = {(r["label"], r["metric"]): r["spread_pct"] for r in rows if r["arm"] == NULL_ARM}
    out = []
    for r in rows:
        if r["arm"] == NULL_ARM:
            continue
        b = base.get((r["arm"], r["label"], r["metric"]))
        if b is None or b.get("median") is None:
            continue
        change = (r["median"] - b["median"]) / (abs(b["median"]) or 1.0) * 100
        worse = change if lower_is_better(r["metric"]) else -change
        tolerance = (null_spread.get((r["label"], r["metric"])) or 0.0) + 1.0
        out.append({"arm": r["arm"], "label": r["label"], "metric": r["metric"], "baseline_median": b["median"],
                    "median": r["median"], "change_pct": change, "worse_pct": worse, "tolerance_pct": tolerance,
                    "regression": worse > tolerance})
    return out


# -- report ----------------------------------------------------------------------------------------------

def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0 or 0.01 <= abs(v) < 1e7:
        return f"{v:.4g}" if abs(v) < 100 else f"{v:.1f}"
    return f"{v:.3e}"


def report_text(doc: dict[str, Any]) -> str:
    """The stdout table."""
    lines = []
    host = doc["host"]
    lines.append(f"bench_rounds: {doc['settings']['rounds']} rounds x {len(doc['order'][0]) if doc['order'] else 0} "
                 f"arms, {host['cpu_count']} cores, {'; '.join(host['gpus']) or 'no GPU'}, {doc['date']}"
                 + ("  [BUSY]" if doc["busy"] else ""))
    failed = [r for r in doc["runs"] if r["status"] != "ok"]
    for arm in doc["arms"]:
        runs = [r for r in doc["runs"] if r["arm"] == arm["name"]]
        ok = sum(r["status"] == "ok" for r in runs)
        lines.append(f"  {arm['name']}: {ok}/{len(runs)} runs ok  ({arm['command']})")
    for r in failed:
        lines.append(f"  round {r['round']} {r['arm']}: {r['status']}: {r['error']}")
    reasons = list(dict.fromkeys(reason for g in doc["gates"] for reason in g["reasons"]))
    if doc["busy"] and reasons:
        lines.append("  busy host: " + "; ".join(reasons))
    if doc.get("stopped"):
        lines.append(f"  stopped early: {doc['stopped']}")
    if any(not s["constant"] for s in doc["stats"]):
        head = ("label", "metric", "arm", "median", "min", "max", "spread", "n", "ratio")
        table = [head]
        prev = None
        for s in (s for s in doc["stats"] if not s["constant"]):
            key = (s["label"], s["metric"])
            new_label = prev is None or s["label"] != prev[0]
            table.append(((s["label"] or "-") if new_label else "", s["metric"] if key != prev else "", s["arm"],
                          _fmt(s["median"]), _fmt(s["min"]), _fmt(s["max"]),
                          "-" if s["spread_pct"] is None else f"{s['spread_pct']:.1f}%", str(s["n"]),
                          "-" if s["ratio"] is None else f"{s['ratio']:.3f}"))
            prev = key
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        lines.append("")
        for row in table:
            lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    if doc["constants"]:
        lines.append("constant: " + ", ".join(f"{k}={_fmt(v)}" for k, v in doc["constants"].items()))
    null = doc.get("null")
    if null:
        pct = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        ratio = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"noise floor (null arm = {doc['arms'][0]['name']} again): spread up to "
                     f"{pct(null['max_spread_pct'])} % (median {pct(null['median_spread_pct'])} %), ratio to "
                     f"{doc['arms'][0]['name']} {ratio(null['ratio_min'])}..{ratio(null['ratio_max'])}")
    base = doc.get("baseline")
    if base:
        regs = [c for c in base["comparisons"] if c["regression"]]
        lines.append(f"baseline {base['file']} ({base.get('date') or '?'}): {len(base['comparisons'])} medians "
                     f"compared, {len(regs)} regression(s)")
        for c in base["comparisons"]:
            if c["regression"]:
                lines.append(f"  REGRESSION {c['arm']} {c['label'] + ' ' if c['label'] else ''}{c['metric']}: "
                             f"{_fmt(c['baseline_median'])} -> {_fmt(c['median'])} ({c['change_pct']:+.1f} %, "
                             f"worse by more than {c['tolerance_pct']:.1f} %)")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_rounds.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", action="append", required=True, metavar="NAME=COMMAND",
                    help="an arm: its name and command line (repeat; the first is the reference)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run before it is killed (default 600)")
    ap.add_argument("--no-null", action="store_true", help="no null arm (the first arm run twice per round)")
    ap.add_argument("--metrics", help="comma-separated fnmatch patterns of the metrics to keep (default: all)")
    ap.add_argument("--json", metavar="FILE", help="write the whole report (raw samples, commands, host) as JSON")
    ap.add_argument("--baseline", metavar="FILE", help="an earlier --json output: flag medians worse than it "
                                                       "by more than the null arm's spread + 1 %% (exit 1)")
    ap.add_argument("--allow-busy", action="store_true", help="run on a busy host and flag the report `busy`")
    ap.add_argument("--max-load", type=float, default=0.5,
                    help="CPU busy above this many runnable tasks per core (default 0.5)")
    ap.add_argument("--max-gpu-util", type=float, default=10.0, help="GPU busy above this utilization %% (default 10)")
    ap.add_argument("--settle", type=float, default=30.0,
                    help="seconds to wait between rounds for a busy host to quiet down (default 30)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        arms = [parse_arm(spec) for spec in a.arm]
    except ValueError as exc:
        ap.error(str(exc))
    if len({arm.name for arm in arms}) != len(arms):
        ap.error("--arm: two arms have the same name")
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    if not a.timeout > 0:
        ap.error("--timeout must be > 0")
    if a.json:  # an unwritable report path is found now, not after the rounds
        out = Path(a.json)
        if out.is_dir() or not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
            ap.error(f"--json {a.json}: cannot write there (missing folder, a folder, or no permission)")
    baseline = None
    if a.baseline:
        try:
            baseline = json.loads(Path(a.baseline).read_text())
            if not isinstance(baseline, dict) or not isinstance(baseline.get("stats"), list):
                raise ValueError("not a bench_rounds --json file (no stats)")
        except (OSError, ValueError) as exc:
            print(f"bench_rounds: error: --baseline {a.baseline}: {exc}", file=sys.stderr)
            return 2
    patterns = [p.strip() for p in a.metrics.split(",") if p.strip()] if a.metrics else None
    if not a.no_null:
        arms.append(Arm(NULL_ARM, arms[0].command, arms[0].argv, arms[0].env))
    by_name = {arm.name: arm for arm in arms}
    names = [arm.name for arm in arms]

    gates = [host_check(a.max_load, a.max_gpu_util)]
    busy = gates[0]["busy"]
    if busy and not a.allow_busy:
        print(f"bench_rounds: the host is busy ({'; '.join(gates[0]['reasons'])}); wait, or pass --allow-busy",
              file=sys.stderr)
        return 3
    host = host_info()
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    order = schedule(names, a.rounds)
    runs: list[Run] = []
    stopped = None
    for r, arms_in_order in enumerate(order):
        round_busy = gates[-1]["busy"]
        if r > 0:
            gate = wait_quiet(a.max_load, a.max_gpu_util, a.settle)
            gate["before_round"] = r
            gates.append(gate)
            round_busy = gate["busy"]
            if round_busy and not a.allow_busy:
                stopped = f"the host got busy before round {r} ({'; '.join(gate['reasons'])})"
                break
            busy = busy or round_busy
        print(f"round {r + 1}/{a.rounds}: {' '.join(arms_in_order)}", file=sys.stderr, flush=True)
        try:
            for position, name in enumerate(arms_in_order):
                run = run_arm(by_name[name], a.timeout, r + 1, position + 1)
                run.busy = round_busy
                runs.append(run)
                if run.status != "ok":
                    print(f"  {name}: {run.status}: {run.error}", file=sys.stderr, flush=True)
        except KeyboardInterrupt:
            stopped = "interrupted (Ctrl-C)"
            break

    stats, constants = summarize(runs, names, patterns)
    doc: dict[str, Any] = {
        "version": 1, "date": date, "host": host, "busy": busy, "stopped": stopped,
        "settings": {"rounds": a.rounds, "timeout": a.timeout, "null_arm": not a.no_null, "metrics": patterns,
                     "max_load": a.max_load, "max_gpu_util": a.max_gpu_util, "settle": a.settle,
                     "allow_busy": a.allow_busy, "argv": sys.argv if argv is None else argv},
        "arms": [{"name": arm.name, "command": arm.command, "argv": arm.argv, "env": arm.env} for arm in arms],
        "order": order[:len({run.round for run in runs})] if runs else [],
        "gates": gates, "runs": [asdict(run) for run in runs], "stats": stats, "constants": constants,
        "null": null_summary(stats),
    }
    code = 0
    if baseline is not None:
        comparisons = compare(stats, baseline)
        doc["baseline"] = {"file": a.baseline, "date": baseline.get("date"), "host": baseline.get("host"),
                           "comparisons": comparisons}
        if any(c["regression"] for c in comparisons):
            code = 1
    print(report_text(doc), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    dead = [arm.name for arm in arms if not any(run.arm == arm.name and run.status == "ok" for run in runs)]
    if stopped:
        done = len({run.round for run in runs})
        if stopped.startswith("interrupted"):
            print(f"bench_rounds: interrupted in round {done}", file=sys.stderr)
            return 130
        print(f"bench_rounds: {stopped}; stopped after {done} round(s) (--allow-busy runs on)", file=sys.stderr)
        return 3
    if dead and runs:
        first = next(run for run in runs if run.arm == dead[0])
        print(f"bench_rounds: every run of {', '.join(dead)} failed; the first: {first.error}", file=sys.stderr)
        return 4
    return code


if __name__ == "__main__":
    sys.exit(main())
