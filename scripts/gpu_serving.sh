#!/usr/bin/env bash
# Issue 16's side-by-side on one H200: llama.cpp CUDA (llama-bench, llama-batched-bench,
# llama-server -np 64 -cb) and monobatch (bench rounds with a null arm, bench-serve against
# `monobatch serve`, --deterministic) on the same machine in the same lease, the same random-weight
# shapes on both sides (F16 GGUFs written by scripts/write_shape_gguf.py; monobatch's own bench
# uses --dummy-weights of the same shape, monobatch serve loads the same GGUF as llama-server).
#
# Prepared here (CPU machine), once:  bash scripts/llama_cpp_src.sh     (.llama-cpp/: source tarball + tokenizer GGUF)
# On the device, two calls back to back (carry .whl and .llama-cpp; the machine keeps /tmp only
# ~30 s after a call, so make the second call at once):
#   bash scripts/gpu_serving.sh build "$OUT"   install .whl/ into /tmp/site; build llama.cpp CUDA in /tmp
#                                               (setsid, survives the call) while writing the GGUFs;
#                                               waits for both (at most BUILD_WAIT s, default 540)
#   bash scripts/gpu_serving.sh bench "$OUT"   the measurements, at most BUDGET s (default 540);
#                                               waits for a build still running first
# (`all` = build then bench, for a machine held longer; `start` = start the build and the GGUFs in
# the background and return, so that the same call can run bench steps that need neither, with NOWAIT=1.) Every step runs under `timeout`, trimmed to
# what is left of BUDGET; a step that does not fit is skipped and says so in log.txt.
# env: STEPS (default "llama rounds serve det": which bench steps; also gemma (issue 18: gemma3-1b
#      B=1), packed (issue 17: the QUANTS files on both engines), accept (CUDA tests TESTS with -k
#      TESTS_K, check_batching on llama-1b and gemma3-1b, `parity --device cuda` when MODEL names a
#      GGUF)), GGUF_SHAPES (default "llama-1b smollm2-135m"), QUANTS (llama-quantize jobs, e.g.
#      "llama-1b:Q4_0 llama-8b:Q4_K_M"), NOWAIT (bench without waiting for the build), ROUNDS (3: monobatch rounds),
#      SERVE_ROUNDS (2), PROMPTS (500), CONC (64), IN_LEN (256), OUT_LEN (128), W (/tmp/gpu_serving:
#      build, GGUFs, logs), BUDGET (540 s); sizes for a CPU smoke test of the plumbing: LB_P (256,8192),
#      LB_D (256,8192), LB_R (5), NPL (32,64,128,256), BB_C (131072), LS_C (65536), DEVICE (cuda),
#      SERVE_FLAGS (extra `monobatch serve` flags, e.g. "-t 1"), PACKED_ARMS (the packed step's
#      monobatch weights, default "packed dequant")
# Writes into OUTDIR (8 files): gpu.txt (machine, versions), log.txt (every step, its time and exit
# status, the summary table), llama_cpp.txt (llama-bench's markdown, batched-bench's and the
# servers' logs), llama_cpp.jsonl (llama-bench and llama-batched-bench JSON lines), rounds.json and
# rounds.txt (monobatch rounds; rounds.txt also holds the serving rounds' report), serve.json (the
# serving rounds: bench-serve against llama-server, monobatch serve, and llama-server again as null),
# det.jsonl (monobatch bench --deterministic). `python3 scripts/gpu_serving_summary.py OUTDIR` prints
# the targets table again from those files.
set -uo pipefail
PHASE=${1:?usage: gpu_serving.sh build|bench|all OUTDIR}
OUT=${2:?usage: gpu_serving.sh build|bench|all OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
REPO=$(pwd)
W=${W:-/tmp/gpu_serving}
SRC_TGZ=${SRC_TGZ:-$REPO/.llama-cpp/llama.cpp.tar.gz}
TOK_GGUF=${TOK_GGUF:-$REPO/.llama-cpp/smollm2-tokenizer.gguf}
BIN=$W/build/bin
G1=$W/llama-1b-f16.gguf
G2=$W/smollm2-135m-f16.gguf
LOG=$OUT/log.txt
START=$SECONDS
mkdir -p "$W"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

log() { printf '[%s +%4ds] %s\n' "$(date -u +%H:%M:%S)" $((SECONDS - START)) "$*" | tee -a "$LOG" >&2; }  # stderr: a step's stdout may be piped to a JSONL file

# t SECONDS CMD...: run CMD under timeout, trimmed to the time left before DEADLINE (minus a
# margin); skip it when less than 10 s would be left. Logs the exit status and the wall time.
t() {
  local want=$1; shift
  local left=$((DEADLINE - SECONDS - 15))
  ((left < want)) && want=$left
  if ((want < 10)); then log "SKIPPED (no time left): $*"; return 124; fi
  local t0=$SECONDS rc
  timeout -k 10 -s INT "$want" "$@"; rc=$?
  log "rc=$rc in $((SECONDS - t0)) s (limit $want s): $*"
  return $rc
}

python_env() {
  export PYTHONPATH=/tmp/site:$REPO/src
  if ! python3 -c "import gguf, fastapi, uvicorn, pydantic, starlette" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$REPO"/.whl/*.whl \
      >> "$LOG" 2>&1 || log "pip install of .whl/ failed"
  fi
  python3 -c "import sys, importlib.metadata as m, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, *(f'{p} {m.version(p)}' for p in ('gguf', 'fastapi', 'uvicorn', 'httpx')))" 2>&1 | tee -a "$LOG"
}

machine_info() {
  { echo "# $(date -u +%FT%TZ) gpu_serving.sh $PHASE"; nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,utilization.gpu,clocks.max.sm --format=csv
    echo "cpus $(nproc); $(uname -r); load $(cut -d' ' -f1-3 /proc/loadavg)"
    git -C "$REPO" rev-parse HEAD 2>/dev/null && git -C "$REPO" status --short 2>/dev/null | head -40
    cmake --version | head -1; nvcc --version 2>/dev/null | tail -1; command -v ninja >/dev/null && echo "ninja $(ninja --version)"
    cat "$REPO/.llama-cpp/VERSION" 2>/dev/null; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1
  } >> "$OUT/gpu.txt" 2>&1
}

# -- build phase: llama.cpp CUDA and the GGUFs, both in the background (setsid: they outlive the call)
start_build() {
  if [ -f "$W/build.rc" ] && [ "$(cat "$W/build.rc")" = 0 ]; then log "llama.cpp already built in $W/build"; return; fi
  if [ -f "$W/build.pid" ] && kill -0 "$(cat "$W/build.pid")" 2>/dev/null; then log "llama.cpp build already running"; return; fi
  [ -f "$SRC_TGZ" ] || { log "no $SRC_TGZ: run scripts/llama_cpp_src.sh here and carry .llama-cpp"; echo 1 > "$W/build.rc"; return; }
  rm -f "$W/build.rc"
  local gen="-G Ninja"; command -v ninja >/dev/null || gen=""
  cat > "$W/build.sh" <<EOF
set -x
rm -rf "$W/llama.cpp" && tar -xzf "$SRC_TGZ" -C "$W" || { echo 1 > "$W/build.rc"; exit 1; }
cmake -S "$W/llama.cpp" -B "$W/build" $gen -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \\
  -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_CUDA_NCCL=OFF \\
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \\
  && cmake --build "$W/build" -j16 --target llama-bench llama-batched-bench llama-server llama-quantize
echo \$? > "$W/build.rc"
EOF
  setsid nohup bash "$W/build.sh" > "$W/build.log" 2>&1 < /dev/null &
  echo $! > "$W/build.pid"
  log "llama.cpp build started (pid $!, log $W/build.log)"
}

# The F16 GGUFs (GGUF_SHAPES, default llama-1b smollm2-135m; $W/SHAPE-f16.gguf), then, once the
# build is done, llama-quantize's QUANTS (e.g. "llama-1b:Q4_0 llama-8b:Q4_K_M"; $W/SHAPE-TYPE.gguf).
# Gemma shapes take Gemma's tokenizer (GEMMA_TOK_GGUF), llama-8b SmolLM2's padded to 128,256 tokens.
GEMMA_TOK_GGUF=${GEMMA_TOK_GGUF:-$REPO/.llama-cpp/gemma3-tokenizer.gguf}
start_ggufs() {
  if [ -f "$W/gguf.rc" ] && [ "$(cat "$W/gguf.rc")" = 0 ]; then log "GGUFs already written"; return; fi
  if [ -f "$W/gguf.pid" ] && kill -0 "$(cat "$W/gguf.pid")" 2>/dev/null; then log "GGUF writing already running"; return; fi
  rm -f "$W/gguf.rc"
  { echo "export PYTHONPATH=\"$PYTHONPATH\"; rc=0"
    for shape in ${GGUF_SHAPES:-llama-1b smollm2-135m}; do
      local tok=$TOK_GGUF extra=
      case $shape in gemma3-*) tok=$GEMMA_TOK_GGUF extra=--pool ;; llama-8b) extra="--pad-vocab --pool" ;; esac
      echo "[ -f $W/$shape-f16.gguf ] || python3 $REPO/scripts/write_shape_gguf.py --shape $shape -o $W/$shape-f16.gguf --tokenizer-from $tok --check $extra || rc=1"
    done
    echo "if [ \$rc = 0 ] && [ -n \"${QUANTS:-}\" ]; then"
    echo "  while [ ! -f $W/build.rc ]; do sleep 5; done"
    for q in ${QUANTS:-}; do
      echo "  $BIN/llama-quantize $W/${q%%:*}-f16.gguf $W/${q%%:*}-${q##*:}.gguf ${q##*:} 16 > $W/quantize-${q/:/-}.log 2>&1 || rc=1"
    done
    echo "fi"
    echo "echo \$rc > $W/gguf.rc"
  } > "$W/gguf.sh"
  setsid nohup bash "$W/gguf.sh" > "$W/gguf.log" 2>&1 < /dev/null &
  echo $! > "$W/gguf.pid"
  log "GGUF writing started (pid $!)"
}

# wait_built SECONDS: until both background jobs ended (or the time is up); 0 = both succeeded
wait_built() {
  local until=$((SECONDS + $1))
  while ((SECONDS < until)); do
    [ -f "$W/build.rc" ] && [ -f "$W/gguf.rc" ] && break
    sleep 5
  done
  log "build: rc=$(cat "$W/build.rc" 2>/dev/null || echo running) ($(tail -1 "$W/build.log" 2>/dev/null | cut -c1-120)); GGUFs: rc=$(cat "$W/gguf.rc" 2>/dev/null || echo running)"
  [ "$(cat "$W/build.rc" 2>/dev/null)" = 0 ] && [ "$(cat "$W/gguf.rc" 2>/dev/null)" = 0 ]
}

build_phase() {
  machine_info
  start_build
  start_ggufs
  wait_built "${BUILD_WAIT:-540}"; local rc=$?
  cat "$W/gguf.log" >> "$LOG" 2>/dev/null
  { echo "== build.log (tail)"; tail -40 "$W/build.log"; } >> "$LOG" 2>/dev/null
  ls -la "$BIN" "$W"/*.gguf >> "$LOG" 2>&1
  return $rc
}

# -- bench phase ---------------------------------------------------------------------------------
MB="monobatch bench --dummy-weights --device cuda --json --no-progress"
SERVE_FLAGS=${SERVE_FLAGS:-}

# keep_json TOOL REP: the JSON lines of $W/stdout to $OUT/llama_cpp.jsonl, tagged with the tool;
# everything else to $OUT/llama_cpp.txt
keep_json() {
  grep -s '^{' "$W/stdout" | sed "s/^{/{\"tool\": \"$1\", \"rep\": $2, /" >> "$OUT/llama_cpp.jsonl"
  grep -sv '^{' "$W/stdout" >> "$OUT/llama_cpp.txt"; rm -f "$W/stdout"
}

llama_steps() {
  local J=$OUT/llama_cpp.jsonl T=$OUT/llama_cpp.txt
  [ -x "$BIN/llama-bench" ] || { log "no llama-bench: llama.cpp steps skipped"; return; }
  rm -f "$W/stdout"
  echo "## llama-bench: prefill pp256, pp8192 (llama-1b, smollm2-135m F16), 5 repetitions after a warm-up" >> "$T"
  t 90 "$BIN/llama-bench" -m "$G1,$G2" -ngl 99 -fa on -p "${LB_P:-256,8192}" -n 0 -r "${LB_R:-5}" -o jsonl -oe md > "$W/stdout" 2>> "$T"
  keep_json llama-bench 1
  echo "## llama-bench: decode tg128 at depth 256 and 8192 (B=1: a bare decode, no sampling)" >> "$T"
  t 90 "$BIN/llama-bench" -m "$G1,$G2" -ngl 99 -fa on -p 0 -n 128 -d "${LB_D:-256,8192}" -r "${LB_R:-5}" -o jsonl -oe md > "$W/stdout" 2>> "$T"
  keep_json llama-bench 1
  for rep in 1 2; do
    echo "## llama-batched-bench rep $rep: llama-1b, 128 + 128, B = 32, 64, 128, 256 (prompts not shared)" >> "$T"
    t 120 "$BIN/llama-batched-bench" -m "$G1" -ngl 99 -fa on -c "${BB_C:-131072}" -b 2048 -ub 512 -npp 128 -ntg 128 \
      -npl "${NPL:-32,64,128,256}" --output-format jsonl > "$W/stdout" 2>> "$T"
    keep_json llama-batched-bench $rep
  done
}

rounds_step() {
  local B1="$MB --shape llama-1b -p 256,8192 -n 128 -r 3"
  t 420 python3 scripts/bench_rounds.py --rounds "${ROUNDS:-3}" --timeout 150 --settle 3 --allow-busy --json "$OUT/rounds.json" \
    --arm b1_llama1b="$B1" \
    --arm b1_smollm2="$MB --shape smollm2-135m -p 256 -n 128 -r 3" \
    --arm batched="$MB --shape llama-1b -p 128 -n 128 -r 2 --batch-size 32,64,128,256" \
    >> "$OUT/rounds.txt" 2>&1
}

wait_health() {  # wait_health URL SECONDS PID: 0 once GET URL/health answers 200; 1 if PID died or time ran out
  python3 - "$@" <<'PY'
import os, sys, time, urllib.request
url, limit, pid = sys.argv[1] + "/health", float(sys.argv[2]), int(sys.argv[3])
end = time.monotonic() + limit
while time.monotonic() < end:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(1)
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                sys.exit(0)
    except Exception:
        pass
    time.sleep(0.5)
sys.exit(1)
PY
}

serve_step() {
  [ -f "$G1" ] || { log "no $G1: serving skipped"; return; }
  local LS=http://127.0.0.1:8091 MS=http://127.0.0.1:8092 lpid= mpid= lup= mup=
  if [ -x "$BIN/llama-server" ]; then
    "$BIN/llama-server" -m "$G1" -ngl 99 -fa on -np "${CONC:-64}" -cb -c "${LS_C:-65536}" --host 127.0.0.1 --port 8091 \
      > "$W/llama-server.log" 2>&1 &
    lpid=$!
    wait_health "$LS" 90 "$lpid" && lup=1 && log "llama-server up (pid $lpid)" || log "llama-server did not come up"
  fi
  python3 -m monobatch serve -m "$G1" --device "${DEVICE:-cuda}" $SERVE_FLAGS --host 127.0.0.1 --port 8092 --max-num-seqs "${CONC:-64}" --no-progress \
    > "$W/monobatch-serve.log" 2>&1 &
  mpid=$!
  wait_health "$MS" 180 "$mpid" && mup=1 && log "monobatch serve up (pid $mpid)" || log "monobatch serve did not come up"
  local BS="monobatch bench-serve --num-prompts ${PROMPTS:-500} --input-len ${IN_LEN:-256} --output-len ${OUT_LEN:-128} --max-concurrency ${CONC:-64} --num-warmups 2 --label serve --json"
  local arms=()
  [ -n "$lup" ] && arms+=(--arm llama_server="$BS --base-url $LS")
  [ -n "$mup" ] && arms+=(--arm monobatch="$BS --base-url $MS")
  if ((${#arms[@]})); then
    echo "== serving rounds" >> "$OUT/rounds.txt"
    t 300 python3 scripts/bench_rounds.py --rounds "${SERVE_ROUNDS:-2}" --timeout 120 --settle 0 --allow-busy --json "$OUT/serve.json" \
      "${arms[@]}" >> "$OUT/rounds.txt" 2>&1
  fi
  for p in $lpid $mpid; do kill "$p" 2>/dev/null; done
  sleep 3
  for p in $lpid $mpid; do kill -9 "$p" 2>/dev/null; wait "$p" 2>/dev/null; done  # their GPU memory is free after this
  { echo "## llama-server log (head, tail)"; head -60 "$W/llama-server.log"; echo ...; tail -30 "$W/llama-server.log"; } >> "$OUT/llama_cpp.txt" 2>/dev/null
  { echo "== monobatch serve log (tail)"; tail -30 "$W/monobatch-serve.log"; } >> "$LOG" 2>/dev/null
}

det_step() {
  t 180 python3 -m $MB --shape llama-1b -p 256,8192 -n 128 -r 1 --deterministic >> "$OUT/det.jsonl" 2>> "$LOG"
  t 180 python3 -m $MB --shape llama-1b -p 128 -n 128 -r 1 --batch-size 64 --deterministic >> "$OUT/det.jsonl" 2>> "$LOG"
}

# Issue 18: Gemma 3 1B's shape, B=1 (llama.cpp on the F16 GGUF, monobatch on the same shape's dummy weights).
gemma_step() {
  local G=$W/gemma3-1b-f16.gguf T=$OUT/llama_cpp.txt
  if [ -x "$BIN/llama-bench" ] && [ -f "$G" ]; then
    echo "## llama-bench gemma3-1b F16: pp256; tg128 at depth 256" >> "$T"
    t 60 "$BIN/llama-bench" -m "$G" -ngl 99 -fa on -p 256 -n 0 -r 5 -o jsonl > "$W/stdout" 2>> "$T"; keep_json llama-bench-gemma 1
    t 60 "$BIN/llama-bench" -m "$G" -ngl 99 -fa on -p 0 -n 128 -d 256 -r 5 -o jsonl > "$W/stdout" 2>> "$T"; keep_json llama-bench-gemma 1
  else log "no llama-bench or $G: llama.cpp gemma steps skipped"; fi
  t 120 python3 -m $MB --shape gemma3-1b -p 256 -n 128 -r 3 >> "$OUT/gemma.jsonl" 2>> "$LOG"
  t 120 python3 -m $MB --shape gemma3-1b -p 128 -n 128 -r 1 --batch-size 32 >> "$OUT/gemma.jsonl" 2>> "$LOG"
}

# Issue 17: the QUANTS files on both engines (monobatch loads the same GGUF, packed by default).
packed_step() {
  local T=$OUT/llama_cpp.txt q f
  for q in ${QUANTS:-}; do
    f=$W/${q%%:*}-${q##*:}.gguf
    [ -f "$f" ] || { log "no $f: skipped"; continue; }
    if [ -x "$BIN/llama-bench" ]; then
      echo "## llama-bench $q: pp2048; tg128 at depth 256" >> "$T"
      t 60 "$BIN/llama-bench" -m "$f" -ngl 99 -fa on -p 2048 -n 0 -r 3 -o jsonl > "$W/stdout" 2>> "$T"; keep_json "llama-bench-$q" 1
      t 60 "$BIN/llama-bench" -m "$f" -ngl 99 -fa on -p 0 -n 128 -d 256 -r 3 -o jsonl > "$W/stdout" 2>> "$T"; keep_json "llama-bench-$q" 1
      case $q in *Q4_0) echo "## llama-batched-bench $q 128 + 128, B = 64" >> "$T"
        t 60 "$BIN/llama-batched-bench" -m "$f" -ngl 99 -fa on -c 32768 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 64 --output-format jsonl > "$W/stdout" 2>> "$T"
        keep_json "llama-batched-bench-$q" 1 ;; esac
    fi
    # monobatch on the same file: packed (the default) and dequantized at load
    for w in ${PACKED_ARMS:-packed dequant}; do
      t $([ "${q%%:*}" = llama-8b ] && echo 240 || echo 120) \
        python3 -m monobatch bench -m "$f" --device cuda \
        --json --no-progress --weights $w -p 256,2048 -n 128 -r 2 | sed "s/^{/{\"file\": \"$q $w\", /" >> "$OUT/packed.jsonl" 2>> "$LOG"
      case $q in *Q4_0)
        t 90 python3 -m monobatch bench -m "$f" --device cuda \
          --json --no-progress --weights $w -p 128 -n 128 -r 1 --batch-size 64 | sed "s/^{/{\"file\": \"$q $w\", /" >> "$OUT/packed.jsonl" 2>> "$LOG" ;;
      esac
    done
  done
}

# Acceptance checks on the GPU: the CUDA kernel tests (TESTS; none = skip), batching invariants on
# CHECK_SHAPES (default llama-1b gemma3-1b; check_batching: batch, chunking, cache hits,
# paged/dense), and, with MODEL set (the bundled GGUF assembled on the device), `monobatch parity
# --device cuda` (deterministic with packed and dequantized weights, then the default mode).
accept_step() {
  if [ "${TESTS:-}" != none ]; then
    PYTHONPATH=$PYTHONPATH:$REPO/tests t 240 python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_varlen_attention.py tests/test_invariant_gemm.py} -k "${TESTS_K:-cuda or captured or invariant}" \
      > "$OUT/tests.txt" 2>&1; tail -5 "$OUT/tests.txt" | tee -a "$LOG"
  fi
  for shape in ${CHECK_SHAPES-llama-1b gemma3-1b}; do
    t 90 python3 scripts/check_batching.py --shape $shape --device cuda -n 32 > "$OUT/check_batching-$shape.json" 2>> "$LOG"
  done
  if [ -n "${MODEL:-}" ]; then
    for w in packed dequant; do
      t 200 python3 -m monobatch parity -m "$MODEL" --device cuda --weights $w --deterministic --expect-identical --no-progress \
        --json "$OUT/parity-det-$w.json" > "$OUT/parity-det-$w.txt" 2>&1
    done
    t 150 python3 -m monobatch parity -m "$MODEL" --device cuda --no-progress --json "$OUT/parity-default.json" > "$OUT/parity-default.txt" 2>&1
  fi
}

bench_phase() {
  DEADLINE=$((SECONDS + ${BUDGET:-540}))
  machine_info
  nvidia-smi --query-compute-apps=pid,name,used_memory --format=csv >> "$OUT/gpu.txt" 2>&1
  if [ -z "${NOWAIT:-}" ] && ! { [ -f "$W/build.rc" ] && [ -f "$W/gguf.rc" ]; }; then
    log "waiting for the build phase to finish"
    start_build; start_ggufs  # no-ops while they run; restarts them on a fresh machine
    wait_built 300
  fi
  for s in ${STEPS:-llama rounds serve det}; do
    log "== $s"
    case $s in
      llama) llama_steps ;; rounds) rounds_step ;; serve) serve_step ;; det) det_step ;;
      gemma) gemma_step ;; packed) packed_step ;; accept) accept_step ;;
      *) log "unknown step $s" ;;
    esac
  done
  python3 scripts/gpu_serving_summary.py "$OUT" 2>&1 | tee -a "$LOG"
  log "bench phase done"
}

case $PHASE in
  build) python_env; build_phase ;;
  start) python_env; machine_info; start_build; start_ggufs ;;
  bench) python_env; bench_phase ;;
  all) python_env; build_phase; bench_phase ;;
  *) echo "usage: gpu_serving.sh build|start|bench|all OUTDIR" >&2; exit 2 ;;
esac
