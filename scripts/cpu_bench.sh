#!/usr/bin/env bash
# The CPU benchmark session behind docs/benchmarks/data/2026-11-29-cpu/ (2 threads, float32):
# interleaved rounds of B=1 engine-direct vs server-in-process on the bundled model and the
# smollm2-135m shape (random weights), HTTP end to end, batched decode (B <= 8), the 8,064-token
# prompt, and bench-serve against a running server.   Usage: bash scripts/cpu_bench.sh OUTDIR
set -u
D=${1:?OUTDIR}
mkdir -p "$D"
M=".venv/bin/monobatch"
.venv/bin/python scripts/bench_rounds.py --rounds 3 --timeout 400 --settle 20 --allow-busy --json "$D/rounds_cpu2.json" \
  --arm bundled='monobatch bench -t 2 -p 256 -n 64 -r 2 --path engine,server --json' \
  --arm smollm2_shape='monobatch bench -t 2 --dummy-weights --shape smollm2-135m -p 256 -n 64 -r 2 --path engine,server --json' \
  > "$D/rounds_cpu2.txt" 2>&1
$M bench -t 2 -p 256 -n 64 -r 2 --path http --json > "$D/http_cpu2.jsonl" 2>&1
$M bench -t 2 --dummy-weights --shape smollm2-135m -p 256 -n 32 -r 1 --batch-size 1,4,8 --json > "$D/batched_cpu2.jsonl" 2>&1
$M bench -t 2 -p 8064 -n 16 -r 1 --json > "$D/p8064_cpu2.jsonl" 2>&1
$M serve -t 2 --port 18765 > "$D/serve.log" 2>&1 &
SERVER=$!
for i in $(seq 60); do curl -sf http://127.0.0.1:18765/health >/dev/null && break; sleep 1; done
$M bench-serve --base-url http://127.0.0.1:18765 --num-prompts 24 --request-rate 2 --max-concurrency 8 \
  --input-len 128 --output-len 32 --json > "$D/bench_serve_cpu2.json" 2>&1
kill -INT $SERVER; wait $SERVER
