#!/usr/bin/env bash
# Issue 16's serving row in one device call, as short as it can be: llama.cpp CUDA is built in the
# background (scripts/gpu_serving.sh start) while `monobatch serve` loads and warms up on the
# llama-1b F16 GGUF, then llama-server starts on the same file and scripts/bench_rounds.py runs
# bench-serve against llama-server, monobatch serve and llama-server again (null arm), one round.
# The monobatch arm is the server's first traffic after start-up (bench-serve's two warm-up
# requests aside): its TTFT tail is the first burst's.
#   Usage (device tool, repo root, carry .whl and .llama-cpp): bash scripts/gpu_serve_first_burst.sh OUTDIR
#   env: ROUNDS (1), PROMPTS (300), CONC (64), IN_LEN (256), OUT_LEN (128), W (/tmp/gpu_serving)
set -uo pipefail
OUT=${1:?OUTDIR}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export W=${W:-/tmp/gpu_serving} GGUF_SHAPES=llama-1b PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
bash scripts/gpu_serving.sh start "$OUT" > /dev/null 2>&1  # build + GGUF in the background; installs .whl into /tmp/site
export PYTHONPATH=/tmp/site:$PWD/src
G=$W/llama-1b-f16.gguf LS=http://127.0.0.1:8091 MS=http://127.0.0.1:8092
log() { echo "[$(date -u +%T) +${SECONDS}s] $*" | tee -a "$OUT/log.txt"; }
health() { for _ in $(seq "$2"); do curl -sf "$1/health" > /dev/null && return 0; kill -0 "$3" 2>/dev/null || return 1; sleep 1; done; return 1; }
for _ in $(seq 200); do [ -f "$W/gguf.rc" ] && break; sleep 2; done
log "GGUF rc $(cat "$W/gguf.rc" 2>/dev/null)"
python3 -m monobatch serve -m "$G" --device cuda --host 127.0.0.1 --port 8092 --max-num-seqs "${CONC:-64}" --no-progress \
  > "$OUT/monobatch-serve.log" 2>&1 &
mpid=$!
health $MS 300 $mpid && log "monobatch serve ready" || log "monobatch serve did not come up"
for _ in $(seq 200); do [ -f "$W/build.rc" ] && break; sleep 2; done
log "llama.cpp build rc $(cat "$W/build.rc" 2>/dev/null || echo running)"
"$W/build/bin/llama-server" -m "$G" -ngl 99 -fa on -np "${CONC:-64}" -cb -c 65536 --host 127.0.0.1 --port 8091 \
  > "$OUT/llama-server.log" 2>&1 &
lpid=$!
health $LS 90 $lpid && log "llama-server ready" || log "llama-server did not come up"
BS="monobatch bench-serve --num-prompts ${PROMPTS:-300} --input-len ${IN_LEN:-256} --output-len ${OUT_LEN:-128} --max-concurrency ${CONC:-64} --num-warmups 2 --label serve --json"
python3 scripts/bench_rounds.py --rounds "${ROUNDS:-1}" --timeout 120 --settle 0 --allow-busy --json "$OUT/serve.json" \
  --arm llama_server="$BS --base-url $LS" --arm monobatch="$BS --base-url $MS" > "$OUT/rounds.txt" 2>&1
log "rounds rc $?"
python3 - "$OUT/serve.json" <<'PY' | tee -a "$OUT/log.txt"
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["runs"]:
    m = r["results"][0]["metrics"] if r.get("results") else {}
    print(r["arm"], {k: m.get(k) for k in ("output_throughput", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms")})
PY
kill $mpid $lpid 2>/dev/null; wait 2>/dev/null
grep -v "GET /health" "$OUT/monobatch-serve.log" | grep -v " finished: " | tail -5 >> "$OUT/log.txt"
