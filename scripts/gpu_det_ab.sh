#!/usr/bin/env bash
# Issue 16's --deterministic rows in one device call (no llama.cpp): the deterministic mode's CUDA
# tests (the invariant GEMM, every door's tokens), the invariant GEMM's prompt tiles
# (scripts/check_gemm_invariance.py: bits against the decode tile's, time beside cuBLAS), then
# scripts/bench_rounds.py over fresh processes, default vs --deterministic, at B=1
# (-p 256,8192 -n 128 -r 3) and B=64 (-p 128 -n 128 -r 1). (On 2026-12-03 it also measured two
# deterministic decode fusions and a 128-row attention tile, reverted after: docs/benchmarks.)
#   Usage (device tool, repo root, carry .whl): bash scripts/gpu_det_ab.sh OUTDIR
#   env: ROUNDS (2), TESTS_S (120), INV_S (120), ROUNDS_S (170 a round), TILES (the invariance check's candidates)
set -uo pipefail
OUT=${1:?OUTDIR}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  > /dev/null 2>&1   # the wheels the device lacks (carry .whl)
log() { echo "[$(date -u +%T) +${SECONDS}s] $*" | tee -a "$OUT/log.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
log "tests"
timeout "${TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider -x \
  "tests/test_varlen_attention.py::test_deterministic_mode_same_tokens_everywhere_cuda" \
  "tests/test_invariant_gemm.py::test_invariant_gemm_cuda" > "$OUT/tests.txt" 2>&1
log "tests rc $?: $(tail -1 "$OUT/tests.txt")"
# prompt-sized tiles of the invariant GEMM: bits against the decode tile's, time beside cuBLAS
timeout "${INV_S:-120}" python3 scripts/check_gemm_invariance.py --shapes llama-1b --no-split --json "$OUT/inv.json" \
  --tiles "${TILES:-128x128x64x8x3,128x128x128x8x3,128x128x64x8x4,128x128x64x4x4,128x256x64x8x4,256x128x64x8x3,128x128x32x8x4,64x256x64x8x3,128x128x128x8x4}" \
  > /dev/null 2> "$OUT/inv.err"
log "invariance rc $?"
B1="monobatch bench --dummy-weights --device cuda --json --no-progress --shape llama-1b -p 256,8192 -n 128 -r 3"
B64="monobatch bench --dummy-weights --device cuda --json --no-progress --shape llama-1b -p 128 -n 128 -r 1 --batch-size 64"
for r in $(seq "${ROUNDS:-2}"); do  # one bench_rounds call a round, so a cut call keeps the rounds before
  timeout "${ROUNDS_S:-170}" python3 scripts/bench_rounds.py --rounds 1 --timeout 150 --settle 2 --allow-busy \
    --json "$OUT/rounds$r.json" \
    --arm default="$B1" --arm det="$B1 --deterministic" \
    --arm default_b64="$B64" --arm det_b64="$B64 --deterministic" \
    --metrics 'decode_tok_s,ttft_ms,total_tok_s,prefill_tok_s' > "$OUT/rounds$r.txt" 2>&1
  log "round $r rc $?"
done
tail -40 "$OUT/rounds1.txt"
