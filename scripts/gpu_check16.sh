#!/usr/bin/env bash
# Issue 16's correctness session on the H200 (device tool, repo root), run while
# `scripts/gpu_serving.sh build` compiles llama.cpp beside it (timings here are not reported:
# the build loads the CPUs): CUDA tests of the varlen attention, the batch-invariant GEMM and the
# kernels around them; the GEMM tile check; batching invariants (default and --deterministic) on
# the llama-1b shape; a host profile of a 256-token prefill.
# Usage: bash scripts/gpu_check16.sh OUTDIR
set -u
OUT=${1:?OUTDIR}; mkdir -p "$OUT"
for i in $(seq 60); do PYTHONPATH=/tmp/site python3 -c "import gguf, fastapi, uvicorn, llguidance" 2>/dev/null && break; sleep 2; done
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
{ timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_varlen_attention.py tests/test_invariant_gemm.py 2>&1 | tail -15
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_decode_graphs.py tests/test_gemv.py tests/test_argmax.py -k "cuda or captured" 2>&1 | tail -8
} > "$OUT/tests.txt"
timeout 150 python3 scripts/check_gemm_invariance.py --json "$OUT/gemm.json" > /dev/null 2>> "$OUT/check_log.txt"
timeout 150 python3 scripts/check_batching.py --shape llama-1b --device cuda -n 32 > "$OUT/check_batching.json" 2>> "$OUT/check_log.txt"
timeout 100 python3 scripts/profile_prefill.py --shape llama-1b -B 1 -p 256 --runs 3 --no-profile --cprofile 40 > "$OUT/cprofile.jsonl" 2>> "$OUT/check_log.txt"
timeout 100 python3 scripts/profile_prefill.py --shape llama-1b -B 64 -p 128 --runs 1 --deterministic --no-profile >> "$OUT/cprofile.jsonl" 2>> "$OUT/check_log.txt"
echo done >> "$OUT/check_log.txt"
