# call 9 (the issue's machine, an H200; END ~560; carry .whl .llama-cpp .device): issue 17's llama-8b row, same run.
# llama.cpp CUDA + the Q4 files built in the background; meanwhile the decode attention's A/B knobs at llama-8b
# (random packed Q4_K, profile_decode; the fastest knob >= 1 % over the default becomes a third arm); then llama-8b
# Q4_K_M on both engines (llama.cpp tg128 at depth 256; monobatch with a short DP4A sweep's table merged into the
# packaged one, then the two-part qkv launch (MONOBATCH_PACKED_GEMV_PAIR=1); llama.cpp pp2048; the knob; the
# packaged table alone; a second round as time allows), then the 1b files if time is left; the CUDA tests of this
# session's kernels run while llama.cpp builds
source .device/common.sh
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
GGUF_SHAPES="llama-8b llama-1b" QUANTS="llama-8b:Q4_K_M llama-1b:Q4_0 llama-1b:Q4_K_M" W=/tmp/gs nice -n 19 bash scripts/gpu_serving.sh start $OUT/gs >/dev/null 2>&1
export MONOBATCH_CUDA_PACKED=1
P="python3 scripts/profile_decode.py --no-profile -n 64 --shape llama-8b --quant Q4_K"
# the attention kernel before 2026-12-06 (its first tile after the wait): `git show 09a1c2c:src/monobatch/kernels/paged_decode.py
# > .device/paged_decode_old.py` before the call
rm -rf /tmp/oldsrc; [ -f .device/paged_decode_old.py ] && cp -r src /tmp/oldsrc && cp .device/paged_decode_old.py /tmp/oldsrc/monobatch/kernels/paged_decode.py
declare -A KNOB=([base]="" [base2]="" [late]="MONOBATCH_DECODE_LATE_TRIGGER=1" [splits4]="MONOBATCH_DECODE_SPLITS=4,2"
  [splits8]="MONOBATCH_DECODE_SPLITS=8,2" [splits16]="MONOBATCH_DECODE_SPLITS=16,2"
  [late_s8]="MONOBATCH_DECODE_LATE_TRIGGER=1 MONOBATCH_DECODE_SPLITS=8,2" [bn32]="MONOBATCH_DECODE_BLOCK_N=32"
  [warps8]="MONOBATCH_DECODE_WARPS=8" [stages1]="MONOBATCH_DECODE_STAGES=1" [wait]="MONOBATCH_PDL_TRIGGER=wait"
  [oldattn]="PYTHONPATH=/tmp/site:/tmp/oldsrc")
# ab TAG CMD...: CMD's stdout to $OUT/ab-TAG.txt, under 90 s and before AB_UNTIL (the build's window: ~370 s)
AB_UNTIL=240
ab() { local tag=$1; shift; local left=$((AB_UNTIL - (SECONDS - T0))); ((left < 25)) && { log "SKIP ab $tag"; return; }
  timeout $((left < 90 ? left : 90)) "$@" > $OUT/ab-$tag.txt 2>>$OUT/err.txt; log "ab $tag rc=$? $(tail -1 $OUT/ab-$tag.txt | cut -c1-150)"; }
for k in base late splits8 stages1 oldattn splits4 splits16 late_s8 bn32 warps8 wait base2; do
  [ $k = oldattn ] && [ ! -d /tmp/oldsrc ] && continue
  ab $k env ${KNOB[$k]} $P
done
for m in small wait small2; do ab 1b-bf16-$m env MONOBATCH_PDL_TRIGGER=${m%2} python3 scripts/profile_decode.py --no-profile -n 64 --shape llama-1b; done
AB_UNTIL=260 ab nopdl-trace env MONOBATCH_PDL=0 $P --trace /tmp/gs/nopdl.json
BEST=$(python3 - $OUT <<'PY'
import json, sys, glob, os
rate = {}
for f in glob.glob(sys.argv[1] + "/ab-*.txt"):
    try:
        rate[os.path.basename(f)[3:-4]] = json.loads(open(f).read().strip().splitlines()[-1])["decode_tok_s"]
    except Exception:
        pass
base = max(rate.get("base", 0), rate.get("base2", 0))
knobs = [k for k in rate if k in ("late", "splits4", "splits8", "splits16", "late_s8", "bn32", "warps8", "stages1")]
best = max(knobs, key=rate.get, default=None)
print(best if best and base and rate[best] >= 1.01 * base else "")
PY
); log "best knob: '${BEST}'"
# a short DP4A sweep at llama-8b's Q4_K and Q6_K products (the tiles the H100's table chose there, and three
# more), merged into this GPU's table (the packaged one: FMA entries only on the H200)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); TB=src/monobatch/kernels/configs/packed_gemv_${GPU// /_}.json
PROBE_DP4A_TILES="32,1024,4,1;32,512,2,1;128,256,4,1;64,256,4,1;16,512,2,1;32,2048,8,1;64,512,4,1;64,256,4,2;32,512,4,2" \
  PROBE_MS=1,4 PROBE_TYPES=Q4_K,Q6_K PROBE_REP=10 timeout $((370 - (SECONDS - T0) > 60 ? 370 - (SECONDS - T0) : 60)) \
  python3 scripts/probe_quant_cuda.py --variant dp4a --only bench --shapes llama-8b --sweep-shapes llama-8b > $OUT/sweep-8b.jsonl 2>>$OUT/err.txt
log "sweep rc=$?"
rm -f /tmp/gs/table.json; [ -f $TB ] && cp $TB /tmp/gs/table.json
python3 scripts/packed_gemv_table.py $OUT/sweep-8b.jsonl --device "$GPU" -o /tmp/gs/table.json > $OUT/table.txt 2>&1; log "table rc=$? $(tail -1 $OUT/table.txt)"
cp /tmp/gs/table.json $OUT/table.json
# the pair's and the decode attention's CUDA tests while llama.cpp builds (the two-part launch's bits; the slow
# PDL writers: q and the newest rows read after the wait), one pytest each, none once the build is done or past 400 s
for t in tests/test_quant_cuda.py::test_dp4a_pair_cuda tests/test_decode_graphs.py::test_attention_waits_for_a_slow_writer \
         tests/test_decode_graphs.py::test_triton_kernel_on_cuda tests/test_kv_window.py::test_window_kernels_cuda; do
  left=$((400 - (SECONDS - T0))); { [ -f /tmp/gs/build.rc ] || ((left < 30)); } && { log "SKIP test ${t##*::}"; continue; }
  PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests timeout $left python3 -m pytest -p no:cacheprovider -o addopts= --tb=short -q $t \
    >> $OUT/tests.txt 2>&1
  log "test ${t##*::} rc=$? $(tail -1 $OUT/tests.txt)"
done
for i in $(seq 80); do [ -f /tmp/gs/llama-8b-Q4_K_M.gguf ] && [ -f /tmp/gs/build.rc ] && ! pgrep -f "llama-quantize /tmp/gs/llama-8b" >/dev/null && break; sleep 5; done
log "build rc=$(cat /tmp/gs/build.rc 2>/dev/null) 8b $(ls -la /tmp/gs/llama-8b-Q4_K_M.gguf 2>&1 | cut -c1-80)"
LB=/tmp/gs/build/bin
bench_file() { local q=$1
  f=/tmp/gs/$q.gguf; [ -f $f ] || { log "no $f"; return; }
  for i in $(seq 12); do pgrep -f "llama-quantize /tmp/gs/${q%-Q4*}" >/dev/null || break; sleep 5; done
  tt 40 lb-$q $LB/llama-bench -m $f -ngl 99 -fa on -p 0 -n 128 -d 256 -r 3 -o jsonl
  MB="python3 -m monobatch bench -m $f --device cuda --json --no-progress --weights packed -p 256,2048 -n 128 -r 3"
  for r in 1 2; do
    MONOBATCH_PACKED_GEMV_CONFIGS=/tmp/gs/table.json tt 60 table-$q-r$r $MB
    case $q in llama-8b*) MONOBATCH_PACKED_GEMV_PAIR=1 MONOBATCH_PACKED_GEMV_CONFIGS=/tmp/gs/table.json tt 60 pair-$q-r$r $MB ;; esac
    [ $r = 1 ] && case $q in llama-8b*) tt 40 lbpp-$q $LB/llama-bench -m $f -ngl 99 -fa on -p 2048 -n 0 -r 3 -o jsonl ;; esac
    [ -n "$BEST" ] && ( export ${KNOB[$BEST]} MONOBATCH_PACKED_GEMV_CONFIGS=/tmp/gs/table.json; tt 60 $BEST-$q-r$r $MB )
    [ $r = 1 ] && tt 60 packaged-$q-r$r $MB
  done
}
bench_file llama-8b-Q4_K_M
bench_file llama-1b-Q4_0
bench_file llama-1b-Q4_K_M
tail -c 1500 $OUT/err.txt
