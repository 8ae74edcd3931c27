#!/usr/bin/env bash
# Where a serving run's TTFT tail comes from (issue 16: bench-serve's TTFT p90/p99 against
# `monobatch serve` sat at ~880 ms while its p50 was ~200 ms). One device call, no llama.cpp:
# writes the llama-1b F16 GGUF (scripts/write_shape_gguf.py, random weights), starts
# `monobatch serve` on it, then runs the same bench-serve ROUNDS times against that one server.
# If the first round's tail is first-use work (Triton JIT compiles, allocator growth) the later
# rounds lose it; the Triton cache (a fresh one) is listed after start-up and after each round, and the server's own
# per-request log lines (TTFT of each request, in completion order) are kept.
#   Usage (device tool, repo root, carry .whl and .llama-cpp): bash scripts/gpu_ttft_probe.sh OUTDIR
#   env: ROUNDS (3), PROMPTS (300), CONC (64), IN_LEN (256), OUT_LEN (128), SERVE_FLAGS, W (/tmp/gpu_serving)
set -uo pipefail
OUT=${1:?OUTDIR}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
REPO=$(pwd); W=${W:-/tmp/gpu_serving}; mkdir -p "$W"
export PYTHONPATH=/tmp/site:$REPO/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import gguf, fastapi" 2>/dev/null ||
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
G=$W/llama-1b-f16.gguf
[ -f "$G" ] || python3 scripts/write_shape_gguf.py --shape llama-1b -o "$G" --tokenizer-from .llama-cpp/smollm2-tokenizer.gguf \
  > "$OUT/gguf.txt" 2>&1 || { echo "GGUF write failed"; tail -5 "$OUT/gguf.txt"; exit 1; }
# a fresh Triton cache, so that a kernel compiled in an earlier call on this machine is compiled again
export TRITON_CACHE_DIR=$W/triton-cache-$$; TC=$TRITON_CACHE_DIR
count() { find "$TC" -name '*.cubin' 2>/dev/null | wc -l; }
names() { find "$TC" -name '*.cubin' 2>/dev/null | xargs -r -n1 basename | sort; }
echo "triton cubins before the server: $(count)" | tee "$OUT/log.txt"
python3 -m monobatch serve -m "$G" --device cuda ${SERVE_FLAGS:-} --host 127.0.0.1 --port 8092 --max-num-seqs "${CONC:-64}" \
  --no-progress > "$OUT/serve.log" 2>&1 &
pid=$!
for i in $(seq 180); do curl -sf http://127.0.0.1:8092/health > /dev/null && break; kill -0 $pid 2>/dev/null || { echo "server died"; tail -20 "$OUT/serve.log"; exit 1; }; sleep 1; done
echo "server up after ${i} s; triton cubins: $(count)" | tee -a "$OUT/log.txt"
names > "$OUT/cubins-ready.txt"
for r in $(seq "${ROUNDS:-3}"); do
  python3 -m monobatch bench-serve --base-url http://127.0.0.1:8092 --num-prompts "${PROMPTS:-300}" --input-len "${IN_LEN:-256}" \
    --output-len "${OUT_LEN:-128}" --max-concurrency "${CONC:-64}" --num-warmups 2 --label "round$r" --json >> "$OUT/bench.jsonl" 2>> "$OUT/log.txt"
  python3 - "$OUT/bench.jsonl" "$r" "$(count)" <<'PY' | tee -a "$OUT/log.txt"
import json, sys
m = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
m = m.get("results", [m])[0].get("metrics", m) if isinstance(m, dict) else m
keys = ("output_throughput", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "duration_s")
print(f"round {sys.argv[2]}: " + ", ".join(f"{k} {m.get(k)}" for k in keys) + f"; triton cubins {sys.argv[3]}")
PY
  names > "$OUT/cubins-round$r.txt"
  echo "--- request log lines so far: $(grep -c 'finished' "$OUT/serve.log")" >> "$OUT/log.txt"
done
kill $pid; wait $pid 2>/dev/null
echo done >> "$OUT/log.txt"
