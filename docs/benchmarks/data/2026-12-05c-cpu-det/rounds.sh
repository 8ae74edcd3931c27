#!/usr/bin/env bash
# The deterministic mode on CPU before and after the unpadded tiles (ADR 0002, "On CPU"): both
# modes of two trees, interleaved rounds, the bundled model, -t 2, prompts of 128 and 512 tokens,
# 64 decoded tokens, median of 3 runs a cell.
#   bash rounds.sh OUT_DIR ROUNDS BASE_SRC NEW_SRC
set -euo pipefail
out=$1 rounds=$2 base=$3 new=$4
mkdir -p "$out"
uptime > "$out/setup.txt"
for r in $(seq 1 "$rounds"); do
  for tree in base new; do
    src=$base; [ "$tree" = new ] && src=$new
    for mode in default det; do
      flag=""; [ "$mode" = det ] && flag=--deterministic
      PYTHONPATH=$src python -m monobatch bench -t 2 -p 128,512 -n 64 -r 3 --json --no-progress $flag \
        | sed "s/^{/{\"round\": $r, \"tree\": \"$tree\", \"mode\": \"$mode\", /" >> "$out/rows.jsonl"
    done
  done
  uptime >> "$out/setup.txt"
done
