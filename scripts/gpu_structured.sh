#!/usr/bin/env bash
# Structured outputs on the H200 (issue 15): the CUDA mask test, constrained vs unconstrained decode
# (B=1 and B=32, ROUNDS interleaved rounds (default 2); ARMS picks among "ab plain constrained
# unforced plain2", default "ab": one process measuring both arms, their runs alternated
# (`bench --constrained ab`: the ratio within a process, as processes of one arm differ by up to
# 1.6x on the H200); plain and plain2 are separate plain processes (a null), constrained and
# unforced separate constrained ones, unforced with MONOBATCH_FORCED_DRAWS=0: no redraw at forced
# grammar positions; PARITY=0 skips the parity runs), and
# parity of the constrained config in both modes. Run on the device after the bundled GGUF was
# assembled at /tmp/model.gguf (see ../shared/tools/split-for-device.sh) and the wheels installed:
#   bash scripts/gpu_structured.sh /tmp/model.gguf "$OUT"      (writes log.txt, bench.jsonl, parity-*.json)
set -uo pipefail
MODEL=${1:?model}; OUT=${2:?out dir}; LOG="$OUT/log.txt"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$LOG"
python3 -m pytest -q tests/test_structured.py -k "bitmask" -p no:cacheprovider >> "$LOG" 2>&1
B="python3 -m monobatch bench -m $MODEL --device cuda -p 128 -n 256 --batch-size 1,32 -r 5 --json --no-progress"
for round in $(seq "${ROUNDS:-2}"); do
  for arm in ${ARMS:-ab}; do
    flag=""; env=""
    [ "$arm" = ab ] && flag="--constrained ab"
    [ "$arm" = constrained ] && flag="--constrained"
    [ "$arm" = unforced ] && flag="--constrained" && env="MONOBATCH_FORCED_DRAWS=0"
    env $env $B $flag 2>>"$LOG" | sed "s/^/{\"round\": $round, \"arm\": \"$arm\", \"row\": /; s/\$/}/" >> "$OUT/bench.jsonl"
  done
done
python3 - "$OUT/bench.jsonl" >> "$LOG" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line); row = r["row"]
    print(r["round"], r["arm"], row["label"], "decode/TG tok/s", row.get("decode_tok_s") or row.get("tg_tok_s"),
          "TTFT ms", row.get("ttft_ms"), "vs plain", row.get("vs_plain"))
PY
[ "${PARITY:-1}" = 0 ] && { cat "$LOG"; exit 0; }
P="python3 -m monobatch parity -m $MODEL --device cuda --configs json,greedy --no-progress"
$P --deterministic --expect-identical --json "$OUT/parity-det.json" >> "$LOG" 2>&1; echo "parity det rc=$?" >> "$LOG"
$P --json "$OUT/parity-fast.json" >> "$LOG" 2>&1; echo "parity fast rc=$?" >> "$LOG"
cat "$LOG"
