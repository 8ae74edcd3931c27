# call 2 (at once after m1, same machine): issue 17 - the Q4 files on both engines, the DP4A GEMV with m1's
# table against its rule, two interleaved rounds; llama-8b's TTFT at 2,048; llama-1b Q4_0 batched B=64.
# Then issue 16's llama.cpp steps (llama-bench, llama-batched-bench) and --deterministic runs, check_batching.
source .device/common.sh
for i in $(seq 60); do [ -f /tmp/gs/build.rc ] && [ -f /tmp/gs/gguf.rc ] && break; sleep 5; done
log "build rc=$(cat /tmp/gs/build.rc 2>/dev/null) gguf rc=$(cat /tmp/gs/gguf.rc 2>/dev/null) table $(ls /tmp/gs/table.json)"
cp /tmp/gs/table.json $OUT/table-used.json 2>/dev/null
export MONOBATCH_CUDA_PACKED=1
LB=/tmp/gs/build/bin
for q in llama-8b-Q4_K_M llama-1b-Q4_0 llama-1b-Q4_K_M; do
  f=/tmp/gs/$q.gguf; [ -f $f ] || { log "no $f"; continue; }
  tt 60 lb-$q $LB/llama-bench -m $f -ngl 99 -fa on -p 0 -n 128 -d 256 -r 3 -o jsonl
  case $q in llama-8b*) tt 60 lbpp-$q $LB/llama-bench -m $f -ngl 99 -fa on -p 2048 -n 0 -r 3 -o jsonl ;; esac
  MB="python3 -m monobatch bench -m $f --device cuda --json --no-progress --weights packed -p 256,2048 -n 128 -r 3"
  for r in 1 2; do
    MONOBATCH_PACKED_GEMV_CONFIGS=/tmp/gs/table.json tt 80 table-$q-r$r $MB
    MONOBATCH_PACKED_GEMV_CONFIGS= tt 80 rule-$q-r$r $MB
  done
done
f=/tmp/gs/llama-1b-Q4_0.gguf
tt 60 lbb-llama-1b-Q4_0 $LB/llama-batched-bench -m $f -ngl 99 -fa on -c 32768 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 16,64 --output-format jsonl
MONOBATCH_PACKED_GEMV_CONFIGS=/tmp/gs/table.json tt 80 b64-llama-1b-Q4_0 python3 -m monobatch bench -m $f --device cuda --json --no-progress --weights packed -p 128 -n 128 -r 2 --batch-size 64
unset MONOBATCH_CUDA_PACKED
W=/tmp/gs STEPS="llama det" NPL=16,32,64,128,256 BUDGET=$((END - (SECONDS - T0) - 75)) bash scripts/gpu_serving.sh bench $OUT/s16 > /dev/null 2>&1
log "issue 16 steps done"
tt 60 batching-det python3 scripts/check_batching.py --shape llama-1b --device cuda --deterministic -n 32
tail -c 1500 $OUT/err.txt
