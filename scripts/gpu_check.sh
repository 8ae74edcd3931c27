#!/usr/bin/env bash
# GPU checks, run on the device machine from the repo root (the test suite runs on CPU in CI):
#   1. the paged-decode kernel tests (Triton vs the torch reference, bf16/fp16, up to 9K keys);
#   2. scripts/check_batching.py on random llama-1b weights: CUDA graphs vs eager decode, paged
#      vs dense, deterministic-mode invariants (JSON, divergences with top-2 margins);
#   3. with the bundled model at /tmp/model.gguf (see ../shared/tools/README.md): the same on
#      the real model, and `monobatch parity --device cuda` (default mode and --deterministic).
# Usage: bash scripts/gpu_check.sh [OUTDIR]   (wheels the machine lacks are taken from .whl/)
set -u
OUT=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import gguf, fastapi, uvicorn" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
nvidia-smi --query-gpu=name,driver_version,utilization.gpu,memory.used --format=csv | tee "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_decode_graphs.py tests/test_kernels.py tests/test_gemv.py tests/test_argmax.py tests/test_pdl_ptx.py -k "cuda or sizes or torch_paged or captured or gemv or argmax or wait" 2>&1 \
    | tail -5 | tee "$OUT/kernel_tests.txt"
timeout 300 python3 scripts/check_batching.py --shape llama-1b --device cuda -n 64 > "$OUT/check_batching_llama1b.json" \
    || echo "check_batching llama-1b failed" | tee -a "$OUT/errors.txt"
if [ -f /tmp/model.gguf ]; then
    timeout 300 python3 scripts/check_batching.py --model /tmp/model.gguf --device cuda > "$OUT/check_batching_smollm2.json" \
        || echo "check_batching smollm2 failed" | tee -a "$OUT/errors.txt"
    for mode in "" --deterministic; do
        timeout 300 python3 -m monobatch parity -m /tmp/model.gguf --device cuda $mode --json "$OUT/parity${mode:+_det}.json" \
            > "$OUT/parity${mode:+_det}.txt" 2>&1
        echo "parity ${mode:-default}: exit $?" | tee -a "$OUT/parity_exit.txt"
    done
fi
