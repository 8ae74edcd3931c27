#!/usr/bin/env bash
# Issue 17, the host work of a CPU decode step (2026-12-02): interleaved A/B rounds of a "before"
# source tree (A) against this checkout (B) on the bundled model:
#   scripts/profile_cpu_decode.py -t 1 -n 48  (step ms, host ms, extension calls a step)
#   monobatch bench -p 128 -n 128 -t 2 -r 2  (decode tok/s)
# BEFORE: a folder holding the older `src/` (e.g. `git archive <commit> src | tar -x -C DIR`); its
# kernels build into their own cache folder at the first run (the cache is per package path).
# This checkout's profile script is run against both trees (it wraps whatever the extension has).
#   Usage: BEFORE=/tmp/mb_before bash scripts/cpu_host_ab.sh OUTDIR [ROUNDS]
set -eu
D=${1:?OUTDIR}
ROUNDS=${2:-3}
B=${BEFORE:?BEFORE=folder with the older src/}
mkdir -p "$D"
PY=.venv/bin/python
{ echo "date $(date -u +%FT%TZ)  host $(nproc) cores  $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
  echo "monobatch $(git rev-parse --short HEAD) (+ working tree) vs $B"; uptime; } > "$D/setup.txt"
for r in $(seq "$ROUNDS"); do
  for arm in before after; do
    src=src; [ "$arm" = before ] && src="$B/src"
    PYTHONPATH=$src $PY scripts/profile_cpu_decode.py -t 1 -n 48 2>/dev/null | tail -1 >> "$D/profile_$arm.jsonl"
  done
  for arm in before after; do
    src=src; [ "$arm" = before ] && src="$B/src"
    PYTHONPATH=$src $PY -m monobatch bench -p 128 -n 128 -t 2 -r 2 --json 2>/dev/null \
      >> "$D/bench_$arm.jsonl"
  done
  echo "round $r done $(date -u +%T)  $(uptime)" >> "$D/setup.txt"
done
$PY - "$D" <<'PYEOF' | tee "$D/summary.txt"
import json, sys
d = sys.argv[1]
for arm in ("before", "after"):
    prof = [json.loads(l) for l in open(f"{d}/profile_{arm}.jsonl") if l.strip()]
    bench = [json.loads(l) for l in open(f"{d}/bench_{arm}.jsonl") if l.strip()]
    print(arm, "step ms", [p["step_wall_ms"] for p in prof], "thread cpu ms", [p["step_thread_cpu_ms"] for p in prof],
          "host ms", [p["host_ms"] for p in prof], "forward host ms", [p["forward_host_ms"] for p in prof],
          "calls/step", prof[0]["extension_calls_per_step"],
          "| -t 2 decode tok/s", [round(b["decode_tok_s"], 1) for b in bench])
PYEOF
