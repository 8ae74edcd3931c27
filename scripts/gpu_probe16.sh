#!/usr/bin/env bash
# Issue 16's first H200 session (device tool, repo root): CUDA tests of the varlen attention and
# the kernels around it, the batch-invariant GEMM's tile check, prefill profiles, and benches.
# Usage: bash scripts/gpu_probe16.sh OUTDIR
set -u
OUT=${1:?OUTDIR}; mkdir -p "$OUT"
python3 -c "import gguf, fastapi, uvicorn, llguidance" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
nvidia-smi --query-gpu=name,driver_version,utilization.gpu,memory.used --format=csv > "$OUT/log.txt"
{ timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_varlen_attention.py 2>&1 | tail -15
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_decode_graphs.py tests/test_gemv.py -k "cuda or captured" 2>&1 | tail -8
} > "$OUT/tests.txt"
timeout 150 python3 scripts/check_gemm_invariance.py --json "$OUT/gemm.json" > /dev/null 2>> "$OUT/log.txt"
P="timeout 100 python3 scripts/profile_prefill.py --runs 3"
{ $P --shape llama-1b -B 128 -p 128; $P --shape llama-1b -B 32 -p 128 --no-profile; $P --shape llama-1b -B 1 -p 256;
  $P --shape smollm2-135m -B 1 -p 256 --no-profile; $P --shape llama-1b -B 128 -p 128 --max-num-batched-tokens 8192 --no-profile
  $P --shape llama-1b -B 1 -p 256 --deterministic --no-profile; $P --shape llama-1b -B 64 -p 128 --deterministic --no-profile
} > "$OUT/profile.jsonl" 2>> "$OUT/log.txt"
B="timeout 120 python3 -m monobatch bench --dummy-weights --device cuda --json --no-progress"
{ $B --shape llama-1b -p 256,8064 -n 128 -r 3; $B --shape smollm2-135m -p 256 -n 128 -r 3
  $B --shape llama-1b -p 128 -n 128 -r 1 --max-num-seqs 256 --batch-size 32,64,128,256
  $B --shape llama-1b -p 256,8064 -n 128 -r 1 --deterministic
} > "$OUT/bench.jsonl" 2>> "$OUT/log.txt"
timeout 90 python3 scripts/check_batching.py --shape llama-1b --device cuda -n 32 > "$OUT/check_default.json" 2>> "$OUT/log.txt"
echo done >> "$OUT/log.txt"
