#!/usr/bin/env bash
# Issue 17's CPU targets in one script (docs/benchmarks, 2026-12-01 packed weights): llama.cpp built
# from source here (scripts/build_llama_cpp.sh) beside monobatch on the bundled model, -t 2, in
# interleaved rounds: llama-bench (pp128, pp512, tgN), monobatch bench with packed weights (prompt
# 128 and 512, N generated tokens) and, in the first round, with dequantized weights; then the
# peak RSS of `generate` (128 generated tokens) in each mode.
#   Usage: bash scripts/cpu_packed_bench.sh OUTDIR [ROUNDS]
#   env: MODEL (a GGUF path, or gemma3 for Gemma 3 270M; default the bundled model),
#        LLAMA_DIR (where llama.cpp is built, default /tmp/llama-cpp), N (generated tokens, default
#        128), REPS (timed runs per configuration and round, default 3), THREADS (default 2)
set -eu
D=${1:?OUTDIR}
ROUNDS=${2:-2}
N=${N:-128}
REPS=${REPS:-3}
T=${THREADS:-2}
mkdir -p "$D"
M=.venv/bin/monobatch
BIN=$(bash scripts/build_llama_cpp.sh "${LLAMA_DIR:-/tmp/llama-cpp}" | tail -1)
MODEL=${MODEL:-$(.venv/bin/python -c "from monobatch.loader import bundled_model_path; print(bundled_model_path())")}
[ "$MODEL" = gemma3 ] && MODEL=$(.venv/bin/python -c "from monobatch.loader.named import named_model_path; print(named_model_path('gemma3'))")
{ echo "date $(date -u +%FT%TZ)  host $(nproc) cores  $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
  echo "monobatch $(git rev-parse --short HEAD)  llama.cpp from $(ls "${LLAMA_DIR:-/tmp/llama-cpp}"/sdist)"
  echo "model $MODEL"; uptime; } > "$D/setup.txt"
for r in $(seq "$ROUNDS"); do
  "$BIN/llama-bench" -m "$MODEL" -t "$T" -p 128,512 -n "$N" -r "$REPS" -o jsonl > "$D/llama_bench_r$r.jsonl" 2> "$D/llama_bench_r$r.err"
  for w in packed $([ "$r" = 1 ] && echo dequant); do
    $M bench -m "$MODEL" -t "$T" --weights "$w" -p 128,512 -n "$N" -r "$REPS" --json > "$D/monobatch_${w}_r$r.jsonl" 2> "$D/monobatch_${w}_r$r.err"
  done
  echo "round $r done $(date -u +%T)  $(uptime)" >> "$D/setup.txt"
done
# peak RSS of one `generate` (prompt 128 tokens' worth of text, 128 generated), each weights mode
P=$(.venv/bin/python -c "import random; from monobatch.synth import synth_text; print(synth_text(random.Random(0), 100))")
for w in packed dequant; do
  /usr/bin/time -f "%M" -o "$D/generate_${w}_maxrss_kb.txt" $M generate -m "$MODEL" -t "$T" --weights "$w" -n 128 --temperature 0 \
    --ignore-eos --output-format json -p "$P" > "$D/generate_${w}.json" 2> "$D/generate_${w}.err"
done
.venv/bin/python scripts/cpu_packed_summary.py "$D" | tee "$D/summary.md"
