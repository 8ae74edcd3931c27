"""scripts/bench_rounds.py: interleaved rounds, the null arm, timeouts, the quiet-host gate and
--baseline, driven with small Python arms (milliseconds) and one real `monobatch bench` arm."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time

import pytest

from server_util import ROOT

SCRIPT = ROOT / "scripts" / "bench_rounds.py"
#: An arm: appends its name to LOG, optionally sleeps (its first run only) or fails, then prints
#: two JSON lines (one labelled, one not) whose rates come from $RATE.
ARM = """
import json, os, sys, time
name, log, mode = sys.argv[1], sys.argv[2], (sys.argv[3] if len(sys.argv) > 3 else "")
with open(log, "a") as f:
    f.write(name + "\\n")
if mode == "sleep-first" and not os.path.exists(log + ".slept"):
    open(log + ".slept", "w").close()
    time.sleep(60)
if mode == "fail":
    print("boom: a bad flag", file=sys.stderr)
    sys.exit(2)
rate = float(os.environ.get("RATE", "100"))
print("a line that is not JSON")
print(json.dumps({"label": "x", "tok_s": rate, "ttft_ms": 1000 / rate, "flag": True, "note": "text"}))
print(json.dumps({"tok_s": rate * 2, "prompt_tokens": 8}))
"""
#: Quick between-round gates for the tests (the host is shared; busy is not the point here).
QUIET = ("--allow-busy", "--settle", "0")


def load_module():
    spec = importlib.util.spec_from_file_location("bench_rounds", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_rounds"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def arm(tmp_path):
    """``arm(name, mode="", rate=None)`` -> the --arm value of a fake arm logging to tmp_path/log."""
    script = tmp_path / "arm.py"
    script.write_text(ARM)
    log = tmp_path / "log"

    def make(name: str, mode: str = "", rate: float | None = None) -> str:
        env = f"RATE={rate} " if rate is not None else ""
        return f"{name}={env}{shlex.quote(sys.executable)} {shlex.quote(str(script))} {name} {log} {mode}".rstrip()

    make.log = log
    return make


def rounds(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def test_rotation_and_null_arm(arm, tmp_path):
    out = tmp_path / "r.json"
    res = rounds("--rounds", "4", "--arm", arm("a"), "--arm", arm("b", rate=50), "--arm", arm("c", rate=200),
                 "--json", str(out), *QUIET)
    assert res.returncode == 0, res.stderr
    # round r starts at arm r mod 4 (the null arm is the fourth); null runs a's command
    expected = [["a", "b", "c", "null"], ["b", "c", "null", "a"], ["c", "null", "a", "b"], ["null", "a", "b", "c"]]
    doc = json.loads(out.read_text())
    assert doc["order"] == expected
    assert [r["arm"] for r in doc["runs"]] == [n for order in expected for n in order]
    assert [(r["round"], r["position"]) for r in doc["runs"][:5]] == [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1)]
    assert arm.log.read_text().split() == [("a" if n == "null" else n) for order in expected for n in order]
    assert [a["name"] for a in doc["arms"]] == ["a", "b", "c", "null"]
    assert doc["arms"][1]["env"] == {"RATE": "50"} and doc["arms"][0]["argv"][0] == sys.executable
    # metrics keyed by (arm, label, metric): numeric fields only, a missing label is ""
    stats = {(s["arm"], s["label"], s["metric"]): s for s in doc["stats"]}
    assert set(stats) == {(a, label, m) for a in ("a", "b", "c", "null")
                          for label, m in (("x", "tok_s"), ("x", "ttft_ms"), ("", "tok_s"), ("", "prompt_tokens"))}
    assert doc["constants"] == {"prompt_tokens": 8} and stats[("b", "", "prompt_tokens")]["constant"]
    s = stats[("b", "x", "tok_s")]
    assert (s["median"], s["min"], s["max"], s["spread_pct"], s["n"]) == (50, 50, 50, 0, 4)
    assert s["ratio"] == 0.5 and stats[("c", "", "tok_s")]["ratio"] == 2.0
    assert stats[("null", "x", "ttft_ms")]["ratio"] == 1.0 and doc["null"]["ratio_min"] == doc["null"]["ratio_max"] == 1
    assert doc["host"]["cpu_count"] == os.cpu_count() and doc["date"] and len(doc["gates"]) == 4
    # the table
    assert "null" in res.stdout and "0.500" in res.stdout and "noise floor" in res.stdout
    assert "constant: prompt_tokens=8" in res.stdout


def test_timeout_is_recorded_not_fatal(arm, tmp_path):
    out = tmp_path / "r.json"
    start = time.monotonic()
    res = rounds("--rounds", "2", "--timeout", "2", "--arm", arm("a"), "--arm", arm("s", "sleep-first", rate=80),
                 "--no-null", "--json", str(out), *QUIET)
    assert time.monotonic() - start < 30  # the 60 s sleeper was killed at 2 s
    assert res.returncode == 0, res.stderr
    doc = json.loads(out.read_text())
    status = {(r["round"], r["arm"]): r["status"] for r in doc["runs"]}
    assert status == {(1, "a"): "ok", (1, "s"): "timeout", (2, "s"): "ok", (2, "a"): "ok"}
    assert "round 1 s: timeout: timed out after 2 s" in res.stdout
    assert {s["n"] for s in doc["stats"] if s["arm"] == "s"} == {1}
    assert {s["n"] for s in doc["stats"] if s["arm"] == "a"} == {2}


def test_an_arm_failing_every_run_is_fatal(arm):
    res = rounds("--rounds", "2", "--arm", arm("a"), "--arm", arm("b", "fail"), *QUIET)
    assert res.returncode == 4
    assert "b: 0/2 runs ok" in res.stdout and "a: 2/2 runs ok" in res.stdout  # the report is still printed
    assert res.stderr.splitlines()[-1] == \
        "bench_rounds: every run of b failed; the first: exit code 2: boom: a bad flag"


def test_busy_gate(arm, tmp_path):
    res = rounds("--max-load", "-1", "--arm", arm("a"))  # a negative limit: always busy
    assert res.returncode == 3 and res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and "busy" in lines[0] and "--allow-busy" in lines[0]
    assert not arm.log.exists()  # nothing ran
    out = tmp_path / "r.json"
    res = rounds("--max-load", "-1", "--rounds", "1", "--arm", arm("a"), "--json", str(out), *QUIET)
    assert res.returncode == 0, res.stderr
    assert "[BUSY]" in res.stdout and "busy host: CPU" in res.stdout
    doc = json.loads(out.read_text())
    assert doc["busy"] is True and all(r["busy"] for r in doc["runs"])


def test_gpu_gate_reads_nvidia_smi(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\ncase \"$1\" in\n"
                    "  --query-gpu=index,utilization.gpu,memory.used) echo '0, 55, 1200'; echo '1, 0, 3';;\n"
                    "  --query-gpu=index,name,memory.total,driver_version) echo '0, NVIDIA H200, 143771, 570.1';;\n"
                    "  --query-compute-apps=pid,process_name,used_memory) echo '4242, python, 1100';;\n"
                    "esac\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    mod = load_module()
    check = mod.host_check(max_load=1e9, max_gpu_util=10)
    assert check["busy"] and [g["utilization_pct"] for g in check["gpus"]] == [55, 0]
    assert any("GPU 0: 55 % utilized" in r for r in check["reasons"])
    assert any("4242, python" in r for r in check["reasons"])
    assert mod.host_info()["gpus"] == ["0, NVIDIA H200, 143771, 570.1"]


def test_baseline_flags_worse_medians(arm, tmp_path):
    base = tmp_path / "base.json"
    res = rounds("--rounds", "2", "--arm", arm("a"), "--arm", arm("b", rate=50), "--json", str(base), *QUIET)
    assert res.returncode == 0, res.stderr
    same = rounds("--rounds", "2", "--arm", arm("a"), "--arm", arm("b", rate=50), "--baseline", str(base), *QUIET)
    assert same.returncode == 0 and "0 regression(s)" in same.stdout, same.stdout
    doc = json.loads(base.read_text())
    for s in doc["stats"]:
        if s["arm"] == "a" and s["label"] == "x":  # a better baseline: a's rate 10 % higher, its time 10 % lower
            s["median"] *= 1.1 if s["metric"] == "tok_s" else 0.9
        if s["arm"] == "b" and s["metric"] in ("tok_s", "ttft_ms"):  # a worse baseline for b: not flagged
            s["median"] *= 0.5 if s["metric"] == "tok_s" else 2
    base.write_text(json.dumps(doc))
    res = rounds("--rounds", "2", "--arm", arm("a"), "--arm", arm("b", rate=50), "--baseline", str(base), *QUIET)
    assert res.returncode == 1, res.stdout + res.stderr
    flagged = sorted(ln.split()[1:4] for ln in res.stdout.splitlines() if ln.strip().startswith("REGRESSION"))
    assert flagged == [["a", "x", "tok_s:"], ["a", "x", "ttft_ms:"]], res.stdout
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    res = rounds("--arm", arm("a"), "--baseline", str(bad), *QUIET)
    assert res.returncode == 2 and "--baseline" in res.stderr and "Traceback" not in res.stderr


def test_real_bench_arm_against_a_better_baseline(tmp_path):
    """`monobatch bench --json` as an arm (run as python -m monobatch); a baseline made from that
    run with far better medians flags a regression of the rate and the time."""
    cmd = "tiny=monobatch bench --dummy-weights --shape tiny -p 8 -n 4 -r 1 -t 1 --json"
    out = tmp_path / "r.json"
    res = rounds("--rounds", "1", "--arm", cmd, "--metrics", "decode_tok_s,ttft_ms,prompt_tokens", "--json", str(out),
                 *QUIET)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(out.read_text())
    assert doc["arms"][0]["argv"][:3] == [sys.executable, "-m", "monobatch"]
    assert [r["status"] for r in doc["runs"]] == ["ok", "ok"]
    stats = {(s["arm"], s["metric"]): s for s in doc["stats"]}
    assert set(stats) >= {("tiny", "decode_tok_s"), ("tiny", "ttft_ms"), ("null", "decode_tok_s")}
    assert stats[("tiny", "decode_tok_s")]["ratio"] == 1.0 and stats[("null", "decode_tok_s")]["ratio"] > 0
    assert any(k.endswith("prompt_tokens") for k in doc["constants"])  # 8 in every run
    # a baseline no real run can reach (a rate of 1e12 tok/s, a TTFT of a picosecond): a baseline
    # only 10x better was not enough on a busy 2-core CI host, where one run's TTFT came out 10x the
    # next one's
    for s in doc["stats"]:
        s["median"] = 1e12 if s["metric"] == "decode_tok_s" else 1e-9
    out.write_text(json.dumps(doc))
    # no null arm this time (one real run, not two): the tolerance is then 1 %
    res = rounds("--rounds", "1", "--arm", cmd, "--metrics", "decode_tok_s,ttft_ms", "--baseline", str(out),
                 "--no-null", *QUIET)
    assert res.returncode == 1, res.stdout + res.stderr
    flagged = [ln for ln in res.stdout.splitlines() if ln.strip().startswith("REGRESSION")]
    assert len(flagged) == 2 and any("decode_tok_s" in ln for ln in flagged) and any("ttft_ms" in ln for ln in flagged)


def test_units():
    mod = load_module()
    assert mod.schedule(["a", "b", "null"], 4) == [["a", "b", "null"], ["b", "null", "a"], ["null", "a", "b"],
                                                    ["a", "b", "null"]]
    assert [mod.lower_is_better(m) for m in ("ttft_ms", "load_s", "decode_tok_s", "tok_s", "request_throughput",
                                             "duration_s")] == [True, True, False, False, False, True]
    # memory and failures are better lower too; counts of successes, speedups and rates higher
    assert [mod.lower_is_better(m) for m in ("peak_rss_mib", "weight_mib", "peak_rss_mb", "weight_mb", "failed",
                                             "errors", "completed", "speedup", "total_token_throughput",
                                             "p99_itl_ms")] == [
        True, True, True, True, True, True, False, False, False, True]
    # against a baseline: more failed requests (from none) and a larger peak RSS are regressions
    rows = [{"arm": "a", "label": "x", "metric": m, "median": v, "spread_pct": 0.0}
            for m, v in (("failed", 3), ("peak_rss_mib", 1100.0), ("output_throughput", 90.0))]
    baseline = {"stats": [{"arm": "a", "label": "x", "metric": m, "median": v}
                          for m, v in (("failed", 0), ("peak_rss_mib", 1000.0), ("output_throughput", 100.0))]}
    got = {c["metric"]: (round(c["change_pct"], 1), c["regression"]) for c in mod.compare(rows, baseline)}
    assert got == {"failed": (300.0, True), "peak_rss_mib": (10.0, True), "output_throughput": (-10.0, True)}
    rows[0]["median"], rows[1]["median"], rows[2]["median"] = 0, 900.0, 110.0
    assert not any(c["regression"] for c in mod.compare(rows, baseline))
    parsed = mod.parse_output('junk\n{"label": "p", "a": 1, "b": true, "c": "x", "d": NaN}\n{"label": "p", "a": 2}\n')
    assert parsed == [{"label": "p", "metrics": {"a": 1}}, {"label": "p#2", "metrics": {"a": 2}}]
    assert mod.parse_output('{\n  "x_ms": 3\n}\n') == [{"label": "", "metrics": {"x_ms": 3}}]
    a = mod.parse_arm("gpu1=CUDA_VISIBLE_DEVICES=1 monobatch bench --json")
    assert a.env == {"CUDA_VISIBLE_DEVICES": "1"} and a.argv == [sys.executable, "-m", "monobatch", "bench", "--json"]
    assert mod.arm_env(a)["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT / "src")
    other = mod.arm_env(mod.parse_arm("old=PYTHONPATH=/o/src monobatch bench"))["PYTHONPATH"].split(os.pathsep)
    assert other[:2] == ["/o/src", str(ROOT / "src")]  # the arm's own code first: an A/B of two checkouts
    for bad in ("nocommand", "=x", "null=monobatch bench"):
        with pytest.raises(ValueError):
            mod.parse_arm(bad)


def test_unwritable_json_is_refused_before_the_rounds(arm, tmp_path):
    res = rounds("--arm", arm("a"), "--json", str(tmp_path / "missing" / "r.json"), *QUIET)
    assert res.returncode == 2 and "--json" in res.stderr.splitlines()[-1] and "Traceback" not in res.stderr
    assert not arm.log.exists()  # no arm ran
