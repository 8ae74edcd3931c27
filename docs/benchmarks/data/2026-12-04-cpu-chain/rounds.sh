#!/usr/bin/env bash
# The CPU decode step's layer chain (issue 17), beside llama.cpp in the same script: interleaved
# rounds of llama-bench and `monobatch bench` on two source trees (the commit before the chain and
# the chain), the bundled model, -t 2; then each tree's host/kernel split of a -t 1 decode step.
#   Usage: bash rounds.sh OUTDIR ROUNDS BASE_SRC NEW_SRC     (run from the repository root)
#   env: LLAMA_BIN (default /tmp/llama-cpp/build/bin), N (generated tokens, 128), REPS (3), PY (.venv/bin/python)
set -eu
D=${1:?OUTDIR}; ROUNDS=${2:-3}; BASE=${3:?BASE_SRC}; NEW=${4:?NEW_SRC}
BIN=${LLAMA_BIN:-/tmp/llama-cpp/build/bin}; N=${N:-128}; REPS=${REPS:-3}
PY=${PY:-.venv/bin/python}
mkdir -p "$D"
MODEL=$(PYTHONPATH=$NEW $PY -c "from monobatch.loader import bundled_model_path; print(bundled_model_path())")
{ echo "date $(date -u +%FT%TZ)  host $(nproc) cores  $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
  echo "base $BASE  new $NEW  model $MODEL"; uptime; } > "$D/setup.txt"
for r in $(seq "$ROUNDS"); do
  "$BIN/llama-bench" -m "$MODEL" -t 2 -p 128 -n "$N" -r "$REPS" -o jsonl > "$D/llama_bench_r$r.jsonl" 2> "$D/llama_bench_r$r.err"
  for arm in base new; do
    src=$BASE; [ $arm = new ] && src=$NEW
    PYTHONPATH=$src $PY -m monobatch bench -m "$MODEL" -t 2 -p 128 -n "$N" -r "$REPS" --json \
      > "$D/monobatch_${arm}_r$r.jsonl" 2> "$D/monobatch_${arm}_r$r.err"
  done
  echo "round $r done $(date -u +%T)  $(uptime)" >> "$D/setup.txt"
done
for arm in base new; do
  src=$BASE; [ $arm = new ] && src=$NEW
  PYTHONPATH=$src $PY scripts/profile_cpu_decode.py -t 1 -n 64 > "$D/profile_${arm}.jsonl" 2> "$D/profile_${arm}.err"
done
