#!/usr/bin/env bash
# Issue 17: how monobatch's CPU decode uses its threads, in interleaved rounds on the bundled model:
# `monobatch bench` (prompt 128, N generated tokens) at -t 1 and -t 2, the -t 2 runs with torch's
# OpenMP threads sleeping (OMP_WAIT_POLICY=PASSIVE) or spinning (OMP_WAIT_POLICY=ACTIVE, as
# llama.cpp's threads do), and with the packed GEMV split over both threads or not
# (MONOBATCH_CPU_MIN_THREAD_WORK: least multiply-adds a thread gets; 2097152 keeps a decode
# step's small GEMVs on one thread, 131072 splits them all). Each run's user+sys CPU seconds too.
#   Usage: bash scripts/cpu_threads_ab.sh OUTDIR [ROUNDS]    env: N (default 64), REPS (default 2)
set -eu
D=${1:?OUTDIR}
ROUNDS=${2:-2}
N=${N:-64}
REPS=${REPS:-2}
mkdir -p "$D"
M=.venv/bin/monobatch
{ echo "date $(date -u +%FT%TZ)  host $(nproc) cores  $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
  echo "monobatch $(git rev-parse --short HEAD)"; uptime; } > "$D/setup.txt"
arm() {  # name, threads, env...
  local name=$1 t=$2; shift 2
  env "$@" /usr/bin/time -f "%U %S" -o "$D/.t" $M bench -t "$t" -p 128 -n "$N" -r "$REPS" --json \
    >> "$D/$name.jsonl" 2>> "$D/$name.err"
  echo "$name $(awk '{print $1 + $2}' "$D/.t")" >> "$D/cpu_seconds.txt"
}
for r in $(seq "$ROUNDS"); do
  arm t1 1
  arm t2_sleep_1thread_gemv 2 OMP_WAIT_POLICY=PASSIVE MONOBATCH_CPU_MIN_THREAD_WORK=2097152
  arm t2_sleep_split_gemv 2 OMP_WAIT_POLICY=PASSIVE MONOBATCH_CPU_MIN_THREAD_WORK=131072
  arm t2_default_split_gemv 2 MONOBATCH_CPU_MIN_THREAD_WORK=131072
  arm t2_spin_split_gemv 2 OMP_WAIT_POLICY=ACTIVE MONOBATCH_CPU_MIN_THREAD_WORK=131072
  arm t2_spin_1thread_gemv 2 OMP_WAIT_POLICY=ACTIVE MONOBATCH_CPU_MIN_THREAD_WORK=2097152
  echo "round $r done $(date -u +%T)  $(uptime)" >> "$D/setup.txt"
done
for f in "$D"/*.jsonl; do
  .venv/bin/python -c "import json, sys; rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]; \
print(sys.argv[1].rsplit('/', 1)[-1][:-6], 'decode tok/s', [round(r['decode_tok_s'], 1) for r in rows])" "$f"
done | tee "$D/summary.txt"
