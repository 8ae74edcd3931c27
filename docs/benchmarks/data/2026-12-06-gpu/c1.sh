# (2026-12-06: arms "new" = this tree, "old" = the attention kernel before its prefetch, both with the merged table)
# call 4 (an H200, the machine, or else an H100): llama.cpp CUDA + the Q4 GGUFs in the background; the DP4A GEMV swept
# at llama-8b's products -> this GPU's table (merged into the packaged one); then llama-8b Q4_K_M on both
# engines (tg128 at depth 256, pp2048; monobatch table vs rule, two rounds), then the 1b files if time is left
source .device/common.sh
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); TB=src/monobatch/kernels/configs/packed_gemv_${GPU// /_}.json
GGUF_SHAPES="llama-8b llama-1b" QUANTS="llama-8b:Q4_K_M llama-1b:Q4_0 llama-1b:Q4_K_M" W=/tmp/gs nice -n 19 bash scripts/gpu_serving.sh start $OUT/gs >/dev/null 2>&1
export MONOBATCH_CUDA_PACKED=1
rm -rf /tmp/oldsrc; cp -r src /tmp/oldsrc; cp .device/paged_decode_old.py /tmp/oldsrc/monobatch/kernels/paged_decode.py
PR="python3 scripts/probe_quant_cuda.py --variant dp4a --only bench"
PROBE_MS=1,4 PROBE_TYPES=Q4_K,Q6_K PROBE_REP=10 timeout 170 $PR --shapes llama-8b --sweep-shapes llama-8b > $OUT/sweep-8b.jsonl 2>>$OUT/err.txt; log "sweep 8b rc=$?"
rm -f /tmp/gs/table.json; [ -f $TB ] && cp $TB /tmp/gs/table.json
python3 scripts/packed_gemv_table.py $OUT/sweep-8b.jsonl --device "$GPU" -o /tmp/gs/table.json > $OUT/table.txt 2>&1; log "table rc=$? $(tail -1 $OUT/table.txt)"
cp /tmp/gs/table.json $OUT/table.json
for i in $(seq 80); do [ -f /tmp/gs/llama-8b-Q4_K_M.gguf ] && [ -f /tmp/gs/build.rc ] && ! pgrep -f "llama-quantize /tmp/gs/llama-8b" >/dev/null && break; sleep 5; done
log "build rc=$(cat /tmp/gs/build.rc 2>/dev/null) 8b $(ls -la /tmp/gs/llama-8b-Q4_K_M.gguf 2>&1 | cut -c1-80)"
LB=/tmp/gs/build/bin
bench_file() { local q=$1

  f=/tmp/gs/$q.gguf; [ -f $f ] || { log "no $f"; return; }
  for i in $(seq 12); do pgrep -f "llama-quantize /tmp/gs/${q%-Q4*}" >/dev/null || break; sleep 5; done
  tt 40 lb-$q $LB/llama-bench -m $f -ngl 99 -fa on -p 0 -n 128 -d 256 -r 3 -o jsonl
  case $q in llama-8b*) tt 40 lbpp-$q $LB/llama-bench -m $f -ngl 99 -fa on -p 2048 -n 0 -r 3 -o jsonl ;; esac
  MB="python3 -m monobatch bench -m $f --device cuda --json --no-progress --weights packed -p 256,2048 -n 128 -r 3"
  for r in 1 2; do
    MONOBATCH_PACKED_GEMV_CONFIGS=/tmp/gs/table.json tt 60 new-$q-r$r $MB
    MONOBATCH_PACKED_GEMV_CONFIGS=/tmp/gs/table.json PYTHONPATH=/tmp/site:/tmp/oldsrc tt 60 old-$q-r$r $MB
  done
}
bench_file llama-8b-Q4_K_M
# what is left: one 8b decode step's GPU timeline (random packed Q4_K weights, the table installed)
MONOBATCH_PACKED_GEMV_CONFIGS=/tmp/gs/table.json tt 60 profile-8b python3 scripts/profile_decode.py --shape llama-8b --quant Q4_K --no-profile -n 32 --trace /tmp/gs/q4k8.json; gzip -c /tmp/gs/q4k8.json > $OUT/trace-8b.json.gz
MONOBATCH_PACKED_GEMV_CONFIGS=/tmp/gs/table.json PYTHONPATH=/tmp/site:/tmp/oldsrc tt 60 profile-8b-old python3 scripts/profile_decode.py --shape llama-8b --quant Q4_K --no-profile -n 32
bench_file llama-1b-Q4_0
bench_file llama-1b-Q4_K_M
bash scripts/triton_cache.sh save $OUT
tail -c 1500 $OUT/err.txt
