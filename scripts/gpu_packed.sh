#!/usr/bin/env bash
# Issue 17's CUDA half on the H200 (device tool, repo root; at most ~8 minutes on a fresh machine,
# Triton compiles included; no llama.cpp): the packed-weight CUDA tests, `monobatch bench` on
# random packed weights (--dummy-weights --quant) beside dense ones (llama-1b Q4_0 B=1 (Q4_K: the
# same nibbles, with factored scales since 2026-12-04: formats.DEVICE_LAYOUTS),
# llama-8b Q4_K B=1 with a 2,048-token prompt for TTFT, llama-1b Q4_0 batched B=64,
# --deterministic), then the kernels timed alone beside dense bf16 with a GEMV config sweep
# (scripts/bench_packed_cuda.py, in the time left). With the bundled GGUF at /tmp/model.gguf
# (../shared/tools/split-for-device.sh): bench packed vs dequant on it and `parity --deterministic
# --expect-identical` on packed weights.
# Usage: bash scripts/gpu_packed.sh OUTDIR   (writes log.txt, tests.txt, bench.jsonl, kernels.jsonl, parity_det_packed.*)
set -u
OUT=${1:?OUTDIR}; mkdir -p "$OUT"
T0=$SECONDS
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
LOG="$OUT/log.txt"
nvidia-smi --query-gpu=name,driver_version,utilization.gpu,memory.used --format=csv > "$LOG"
stamp() { echo "$1 at $((SECONDS - T0)) s" >> "$LOG"; }
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_quant_cuda.py -k "cuda or sm90 or repack or dequantize or compact" \
    > "$OUT/tests.txt" 2>&1; echo "tests exit $?" >> "$LOG"
tail -3 "$OUT/tests.txt" >> "$LOG"; stamp tests
B="python3 -m monobatch bench --dummy-weights --device cuda --json --no-progress"
for args in "--shape llama-1b -p 256 -n 128 -r 3 --quant Q4_0" "--shape llama-1b -p 256 -n 128 -r 3" \
            "--shape llama-8b -p 2048 -n 128 -r 2 --quant Q4_K" "--shape llama-8b -p 2048 -n 128 -r 2" \
            "--shape llama-1b -p 128 -n 128 -r 1 --batch-size 64 --quant Q4_0" "--shape llama-1b -p 128 -n 128 -r 1 --batch-size 64" \
            "--shape llama-1b -p 256 -n 128 -r 2 --quant Q4_0 --deterministic"; do
  if [ $((SECONDS - T0)) -gt 470 ]; then echo "skipped (8-minute budget): $args" >> "$LOG"; continue; fi
  timeout 75 $B $args >> "$OUT/bench.jsonl" 2>> "$LOG" || echo "bench failed ($?): $args" >> "$LOG"
  stamp "bench $args"
done
if [ -f /tmp/model.gguf ] && [ $((SECONDS - T0)) -lt 400 ]; then
  for w in packed dequant; do
    timeout 60 python3 -m monobatch bench -m /tmp/model.gguf --device cuda --weights $w -p 256 -n 128 -r 3 --json --no-progress \
        >> "$OUT/bench.jsonl" 2>> "$LOG" || echo "bench bundled $w failed" >> "$LOG"
  done
  timeout 100 python3 -m monobatch parity -m /tmp/model.gguf --device cuda --weights packed --deterministic --expect-identical \
      --json "$OUT/parity_det_packed.json" > "$OUT/parity_det_packed.txt" 2>&1
  echo "parity --deterministic --expect-identical packed: exit $?" >> "$LOG"; stamp bundled
fi
LEFT=$((460 - (SECONDS - T0)))
if [ $LEFT -gt 30 ]; then
  timeout $LEFT python3 scripts/bench_packed_cuda.py --sweep > "$OUT/kernels.jsonl" 2>> "$LOG"; echo "kernels exit $?" >> "$LOG"
fi
stamp done
