#!/usr/bin/env bash
# The H200 benchmark session behind docs/benchmarks/data/2026-11-29-h200/ (device tool, repo root):
# kernel tests, then interleaved rounds (scripts/bench_rounds.py) of B=1 engine-direct and
# server-in-process decode/TTFT on the llama-1b and smollm2-135m shapes (random bf16 weights),
# llama-1b without async scheduling and without PDL as A/B arms, and the first arm
# again as the null arm; batched decode
# throughput (B = 1..128); the end-to-end HTTP path; graphs vs eager and batching invariants.
# Usage: bash scripts/h200_bench.sh OUTDIR      (wheels the machine lacks are taken from .whl/)
set -u
OUT=${1:?OUTDIR}
mkdir -p "$OUT"
python3 -c "import gguf, fastapi, uvicorn" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
nvidia-smi --query-gpu=name,driver_version,utilization.gpu,memory.used --format=csv > "$OUT/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_decode_graphs.py tests/test_gemv.py tests/test_argmax.py tests/test_pdl_ptx.py \
    -k "cuda or sizes or torch_paged or captured or gemv or argmax or wait" > "$OUT/kernel_tests.txt" 2>&1
B="monobatch bench --dummy-weights --device cuda -n 128 -r 3 --path engine,server --json"
timeout -s INT 330 python3 scripts/bench_rounds.py --rounds 3 --timeout 80 --settle 3 --allow-busy --json "$OUT/rounds.json" \
    --arm llama1b="$B --shape llama-1b -p 256,8064" \
    --arm smollm2="$B --shape smollm2-135m -p 256,8064" \
    --arm llama1b_sync="$B --shape llama-1b -p 256 --no-async-scheduling" \
    --arm llama1b_nopdl="MONOBATCH_PDL=0 $B --shape llama-1b -p 256" > "$OUT/rounds.txt" 2>&1
timeout 40 python3 -m monobatch bench --dummy-weights --device cuda --shape llama-1b -p 256 -n 128 -r 1 \
    --max-num-seqs 128 --batch-size 1,8,32,64,128 --json > "$OUT/batched.jsonl" 2>&1
timeout 30 python3 -m monobatch bench --dummy-weights --device cuda --shape llama-1b -p 256 -n 128 -r 3 \
    --path http --json >> "$OUT/batched.jsonl" 2>&1
timeout 60 python3 scripts/check_batching.py --shape llama-1b --device cuda -n 32 > "$OUT/check_batching.json" 2>&1
