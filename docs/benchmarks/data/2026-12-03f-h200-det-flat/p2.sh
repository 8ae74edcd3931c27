#!/usr/bin/env bash
# One device call of A/B rounds (no llama.cpp; every ratio compares monobatch with itself in this
# call, fresh processes, scripts/bench_rounds.py with its null arm):
#  1. llama-1b shape, random weights: the default mode against BASE's tree (a `git archive` of an
#     earlier commit's src, e.g. the paged decode attention before a change), and --deterministic
#     with the batch-invariant GEMM launched with PDL (default), without (MONOBATCH_INVARIANT_PDL=0)
#     and with its K steps in one loop (MONOBATCH_INVARIANT_FLAT=1); B=1, -p 256,8192 -n 128 -r 3.
#  2. structured outputs on the bundled model (MODEL, assembled on the device): plain vs
#     --constrained at B=1 and 32, and --constrained with torch's intra-op threads at one
#     (OMP_NUM_THREADS=1: does the CPU pool's spinning slow the grammar's host work?).
#   Usage (device tool, repo root; wheels installed in /tmp/site):
#     BASE=.base/src MODEL=/tmp/model.gguf bash scripts/gpu_pdl_ab.sh OUTDIR
#   env: ROUNDS (2), DET_S (330: the first part's seconds), CON_S (200)
set -uo pipefail
OUT=${1:?OUTDIR}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src TOKENIZERS_PARALLELISM=false
log() { echo "[$(date -u +%T) +${SECONDS}s] $*" | tee -a "$OUT/log.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
B1="monobatch bench --dummy-weights --device cuda --json --no-progress --shape llama-1b -p 256,8192 -n 128 -r 3"
arms=(--arm default="$B1" --arm det="$B1 --deterministic"
      --arm det_nopdl="MONOBATCH_INVARIANT_PDL=0 $B1 --deterministic"
      --arm det_flat="MONOBATCH_INVARIANT_FLAT=1 $B1 --deterministic")
[ -n "${BASE:-}" ] && arms+=(--arm base="PYTHONPATH=$PWD/$BASE:/tmp/site $B1")
timeout "${DET_S:-330}" python3 scripts/bench_rounds.py --rounds "${ROUNDS:-2}" --timeout 80 --settle 1 --allow-busy \
  --json "$OUT/det.json" "${arms[@]}" --metrics 'decode_tok_s,ttft_ms' > "$OUT/det.txt" 2>&1
log "det rounds rc $?"
if [ -n "${MODEL:-}" ] && [ -f "${MODEL:-}" ]; then
  C="monobatch bench -m $MODEL --device cuda -p 128 -n 256 --batch-size 1,32 -r 3 --json --no-progress"
  timeout "${CON_S:-200}" python3 scripts/bench_rounds.py --rounds "${ROUNDS:-2}" --timeout 60 --settle 1 --allow-busy \
    --json "$OUT/constrained.json" --arm plain="$C" --arm constrained="$C --constrained" \
    --arm constrained_omp1="OMP_NUM_THREADS=1 $C --constrained" \
    --metrics 'decode_tok_s,tg_tok_s' > "$OUT/constrained.txt" 2>&1
  log "constrained rounds rc $?"
fi
tail -30 "$OUT/det.txt"; tail -14 "$OUT/constrained.txt" 2>/dev/null
