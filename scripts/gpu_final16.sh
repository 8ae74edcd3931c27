#!/usr/bin/env bash
# Issue 16's last H200 check of a session (device tool, repo root; ~4 min on a fresh machine):
# CUDA tests of the varlen attention, prefill graphs, batch-invariant GEMM and the kernels around
# them; B=1 TTFT/decode (llama-1b, smollm2) and --deterministic (B=1, batched B=64) beside the
# default mode; batching invariants on the llama-1b shape.   Usage: bash scripts/gpu_final16.sh OUTDIR
set -u
OUT=${1:?OUTDIR}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
nvidia-smi --query-gpu=name,driver_version,utilization.gpu,memory.used --format=csv > "$OUT/log.txt"
{ timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_varlen_attention.py tests/test_invariant_gemm.py 2>&1 | tail -15
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_decode_graphs.py tests/test_gemv.py \
      tests/test_argmax.py $(ls tests/test_kv_window.py 2>/dev/null) -k "cuda or captured" 2>&1 | tail -8
} > "$OUT/tests.txt"
B="timeout 60 python3 -m monobatch bench --dummy-weights --device cuda --json --no-progress"
for args in "--shape llama-1b -p 256 -n 128 -r 3" "--shape smollm2-135m -p 256 -n 128 -r 3" \
            "--shape llama-1b -p 256 -n 128 -r 2 --deterministic" \
            "--shape llama-1b -p 128 -n 128 -r 1 --batch-size 64 --deterministic" "--shape llama-1b -p 128 -n 128 -r 1 --batch-size 64"; do
  $B $args >> "$OUT/bench.jsonl" 2>> "$OUT/log.txt"
done
for shape in llama-1b smollm2-135m; do
  timeout 40 python3 scripts/profile_prefill.py --shape $shape -B 1 -p 256 --runs 5 --no-profile >> "$OUT/profile.jsonl" 2>> "$OUT/log.txt"
done
timeout 70 python3 scripts/check_batching.py --shape llama-1b --device cuda -n 32 > "$OUT/check_batching.json" 2>> "$OUT/log.txt"
echo done >> "$OUT/log.txt"
