#!/usr/bin/env bash
# The packed FMA GEMV (integer-weighted group sums, 2026-12-03) on the H200 (device tool, repo root,
# ~9 minutes on a fresh machine): its CUDA tests, scripts/probe_quant_cuda.py (check at llama-1b's
# shapes, M = 1..4, then the bench and config sweep beside the DOT variant and dense bf16), and
# `monobatch bench` B=1 on llama-1b: dense bf16, packed Q4_0 and packed Q4_K (MONOBATCH_CUDA_PACKED=1).
# Usage (it was scripts/gpu_fma_probe.sh): bash f1.sh OUTDIR [BUDGET_S]   (writes log.txt, tests.txt, probe.txt, bench.jsonl)
set -u
OUT=${1:?OUTDIR}; BUDGET=${2:-540}; mkdir -p "$OUT"
T0=$SECONDS LOG="$OUT/log.txt"; export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version,utilization.gpu,memory.used --format=csv > "$LOG"
git log -1 --format='commit %H %s' >> "$LOG" 2>/dev/null
stamp() { echo "$1 at $((SECONDS - T0)) s" >> "$LOG"; }
B="python3 -m monobatch bench --dummy-weights --device cuda --json --no-progress --shape llama-1b -p 256 -n 128 -r 3"
# the probe first (its check compiles in 12 processes), then the model rows, then the tests
timeout 260 python3 scripts/probe_quant_cuda.py --shapes llama-1b --jobs 12 > "$OUT/probe.txt" 2>> "$LOG"
echo "probe exit $?" >> "$LOG"; grep -c "^PASS" "$OUT/probe.txt" >> "$LOG"; grep "^FAIL" "$OUT/probe.txt" | head -5 >> "$LOG"; stamp probe
for args in "" "--quant Q4_0" "--quant Q4_K" "--quant Q8_0"; do
  if [ $((SECONDS - T0)) -gt $((BUDGET - 60)) ]; then echo "skipped (budget): $args" >> "$LOG"; continue; fi
  MONOBATCH_CUDA_PACKED=1 timeout 60 $B $args >> "$OUT/bench.jsonl" 2>> "$LOG" || echo "bench failed ($?): $args" >> "$LOG"
  stamp "bench $args"
done
LEFT=$((BUDGET - 10 - (SECONDS - T0)))
if [ $LEFT -gt 30 ]; then
  timeout $LEFT python3 -m pytest -q -p no:cacheprovider tests/test_quant_cuda.py -k "fma_gemv_cuda or graph_replay or kernels_cuda or packed_weight_cuda" \
      > "$OUT/tests.txt" 2>&1; echo "tests exit $?" >> "$LOG"; tail -3 "$OUT/tests.txt" >> "$LOG"
fi
stamp done
