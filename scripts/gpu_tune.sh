#!/usr/bin/env bash
# Tuning data from one H200 call (device tool, repo root, carry .whl; ~7 min on a fresh machine), no
# llama.cpp: (1) the CUDA tests of the kernels a tile or split change touches; (2)
# scripts/check_gemm_invariance.py (the batch-invariant GEMM's tiles and split-K: bits and GPU time,
# issue 16's --deterministic rows); (3) monobatch bench, --deterministic beside the default mode
# (B=1 p256 / p8192, batched 64 x (128 + 128)); (4) scripts/profile_decode.py --deterministic (where a
# deterministic decode step's time goes); (5) scripts/bench_packed_cuda.py --sweep on llama-1b
# (issue 17's packed GEMV configs at M = 1 beside the bf16 GEMV).
# Also: (6) `check` — scripts/check_batching.py on llama-1b (batch, chunking, cache hits, paged =
# dense under --deterministic); (7) `wait` — wait for a llama.cpp build that `gpu_serving.sh start`
# began (so that the next call, made at once, finds it: the machine keeps /tmp ~30 s); (8) `structured`
# — scripts/gpu_structured.sh on the bundled model (issue 15's constrained vs plain decode, parity of
# the constrained config); (9) `parity` — `monobatch parity --deterministic --expect-identical` on the
# bundled model, every config. (8) and (9) read the GGUF at $MODEL (default /tmp/model.gguf).
#   Usage: bash scripts/gpu_tune.sh OUTDIR      env: STEPS (default "tests invariance det profile packed"),
#          BUDGET (seconds, default 560: each step is trimmed to what is left), TESTS (pytest files of
#          `tests`), SWEEP (1: `packed` sweeps configs, default 1), W (gpu_serving.sh's work dir)
set -u
OUT=${1:?OUTDIR}; mkdir -p "$OUT"
DEADLINE=$((SECONDS + ${BUDGET:-560}))
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
nvidia-smi --query-gpu=name,driver_version,utilization.gpu,memory.used --format=csv > "$LOG"
git rev-parse HEAD >> "$LOG" 2>&1; git status --short >> "$LOG" 2>&1

# t SECONDS CMD...: CMD under timeout, trimmed to the time left (15 s margin); logs rc and time.
t() {
  local want=$1; shift
  local left=$((DEADLINE - SECONDS - 15)); ((left < want)) && want=$left
  if ((want < 10)); then echo "SKIPPED (no time left): $*" >> "$LOG"; return 124; fi
  local t0=$SECONDS rc; timeout -k 5 -s INT "$want" "$@"; rc=$?
  echo "rc=$rc in $((SECONDS - t0)) s (limit $want s): $*" >> "$LOG"; return $rc
}

for step in ${STEPS:-tests invariance det profile packed}; do
  case $step in
    tests) t 240 python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_invariant_gemm.py tests/test_gemv.py \
             tests/test_quant_cuda.py tests/test_varlen_attention.py tests/test_decode_graphs.py} -k "cuda or captured or invariant" \
             > "$OUT/tests.txt" 2>&1; tail -3 "$OUT/tests.txt" >> "$LOG" ;;
    invariance) t 150 python3 scripts/check_gemm_invariance.py --shapes llama-1b --json "$OUT/invariance.json" \
             > /dev/null 2>> "$LOG" ;;
    det) B="python3 -m monobatch bench --dummy-weights --device cuda --json --no-progress --shape llama-1b"
         for args in "-p 256 -n 128 -r 3" "-p 256 -n 128 -r 3 --deterministic" "-p 8192 -n 32 -r 1" "-p 8192 -n 32 -r 1 --deterministic" \
                     "-p 128 -n 128 -r 1 --batch-size 64" "-p 128 -n 128 -r 1 --batch-size 64 --deterministic"; do
           t 60 $B $args >> "$OUT/bench.jsonl" 2>> "$LOG"
         done ;;
    profile) t 60 python3 scripts/profile_decode.py --shape llama-1b --deterministic -n 64 > "$OUT/profile-det.json" 2>> "$LOG" ;;
    packed) sweep=--sweep; [ "${SWEEP:-1}" = 1 ] || sweep=
            t 200 python3 scripts/bench_packed_cuda.py --shapes llama-1b --ms 1,16 $sweep > "$OUT/packed_kernels.jsonl" 2>> "$LOG" ;;
    check) t 90 python3 scripts/check_batching.py --shape llama-1b --device cuda -n 32 > "$OUT/check_batching.json" 2>> "$LOG" ;;
    structured) t 420 bash scripts/gpu_structured.sh "${MODEL:-/tmp/model.gguf}" "$OUT/structured" > /dev/null 2>> "$LOG"
                tail -14 "$OUT/structured/log.txt" >> "$LOG" 2>/dev/null ;;
    parity) t 240 python3 -m monobatch parity -m "${MODEL:-/tmp/model.gguf}" --device cuda --deterministic --expect-identical \
              --no-progress --json "$OUT/parity-det.json" > "$OUT/parity-det.txt" 2>&1; tail -5 "$OUT/parity-det.txt" >> "$LOG" ;;
    wait) w=${W:-/tmp/gpu_serving}
          while [ ! -f "$w/build.rc" ] || [ ! -f "$w/gguf.rc" ]; do ((SECONDS < DEADLINE - 10)) || break; sleep 5; done
          echo "build rc=$(cat "$w/build.rc" 2>/dev/null || echo running), GGUFs rc=$(cat "$w/gguf.rc" 2>/dev/null || echo running)" >> "$LOG" ;;
  esac
done
echo "done in $SECONDS s" >> "$LOG"
