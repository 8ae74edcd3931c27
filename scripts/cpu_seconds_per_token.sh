#!/usr/bin/env bash
# CPU seconds per decoded token, llama.cpp beside monobatch (packed and dequantized weights), one
# thread, bundled model: a measure that other work on a shared machine does not inflate the way it
# inflates wall-clock tok/s (it still shares caches and, on SMT siblings, a core). Each side runs
# twice, with N and 2N generated tokens after the same prompt; (user + sys of the longer run - the
# shorter) / N is the cost of N decode steps alone (loading, prompt and warm-up cancel out).
#   Usage: bash scripts/cpu_seconds_per_token.sh OUTDIR      env: N (default 128), LLAMA_DIR,
#          MODEL (a GGUF path, or gemma3 for Gemma 3 270M; default the bundled model)
set -eu
D=${1:?OUTDIR}
N=${N:-128}
mkdir -p "$D"
M=.venv/bin/monobatch
BIN=$(bash scripts/build_llama_cpp.sh "${LLAMA_DIR:-/tmp/llama-cpp}" | tail -1)
MODEL=${MODEL:-$(.venv/bin/python -c "from monobatch.loader import bundled_model_path; print(bundled_model_path())")}
[ "$MODEL" = gemma3 ] && MODEL=$(.venv/bin/python -c "from monobatch.loader.named import named_model_path; print(named_model_path('gemma3'))")
cpu() {  # user+sys seconds of a command
  /usr/bin/time -f "%U %S" -o "$D/.t" "$@" > /dev/null 2>> "$D/cpu_seconds.err"
  awk '{print $1 + $2}' "$D/.t"
}
{
  for n in "$N" $((2 * N)); do
    echo "llama.cpp $n $(cpu "$BIN/llama-bench" -m "$MODEL" -t 1 -p 0 -n "$n" -r 1)"
    for w in packed dequant; do
      echo "monobatch-$w $n $(cpu $M generate -m "$MODEL" -t 1 --weights "$w" -n "$n" --ignore-eos --temperature 0 -p 'Once upon a time')"
    done
  done
} | tee "$D/cpu_seconds.txt"
awk -v n="$N" '{t[$1, $2] = $3; k[$1] = 1} END {for (x in k) printf "%s: %.2f ms CPU per decoded token (%d tokens)\n", x, (t[x, 2 * n] - t[x, n]) / n * 1000, n}' \
  "$D/cpu_seconds.txt" | sort | tee "$D/cpu_seconds_summary.txt"
