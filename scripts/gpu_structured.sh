#!/usr/bin/env bash
# Structured outputs on the H200 (issue 15): the CUDA mask test, constrained vs unconstrained decode
# (B=1 and B=32, two interleaved rounds, the plain arm twice per round as a null), and parity of the
# constrained config in both modes. Run on the device after the bundled GGUF was assembled at
# /tmp/model.gguf (see ../shared/tools/split-for-device.sh) and the wheels installed:
#   bash scripts/gpu_structured.sh /tmp/model.gguf "$OUT"
set -uo pipefail
MODEL=${1:?model}; OUT=${2:?out dir}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q tests/test_structured.py -k "bitmask" -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/pytest.txt"
B="python3 -m monobatch bench -m $MODEL --device cuda -p 128 -n 256 --batch-size 1,32 -r 5 --json --no-progress"
for round in 1 2; do
  for arm in plain constrained plain2; do
    flag=""; [ "$arm" = constrained ] && flag="--constrained"
    $B $flag 2>"$OUT/bench-$arm-$round.err" | sed "s/^/{\"round\": $round, \"arm\": \"$arm\", \"row\": /; s/\$/}/" >> "$OUT/bench.jsonl"
  done
done
cat "$OUT/bench.jsonl" | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line); row = r["row"]
    m = row.get("decode_tok_s") or row.get("tg_tok_s")
    print(r["round"], r["arm"], row["label"], "decode/TG tok/s", m, "TTFT", row.get("ttft_ms"))' | tee "$OUT/bench-summary.txt"
P="python3 -m monobatch parity -m $MODEL --device cuda --configs json,greedy --no-progress"
$P --deterministic --expect-identical --json "$OUT/parity-det.json" > "$OUT/parity-det.txt" 2>&1; echo "parity det rc=$?" | tee -a "$OUT/parity-det.txt"
$P --json "$OUT/parity-fast.json" > "$OUT/parity-fast.txt" 2>&1; echo "parity fast rc=$?" | tee -a "$OUT/parity-fast.txt"
tail -12 "$OUT/parity-det.txt" "$OUT/parity-fast.txt"
