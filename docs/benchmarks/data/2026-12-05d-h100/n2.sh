# call 2 (quiet machine): the Q4 files on both engines, packed with the H200 table vs the rule vs the dp4a GEMV
mkdir -p /tmp/stage && cp .device-parts/0/part /tmp/stage/00
source .device/common.sh
for i in $(seq 60); do [ -f /tmp/gs/build.rc ] && [ -f /tmp/gs/gguf.rc ] && break; sleep 5; done
log "build rc=$(cat /tmp/gs/build.rc 2>/dev/null) gguf rc=$(cat /tmp/gs/gguf.rc 2>/dev/null)"
export MONOBATCH_CUDA_PACKED=1
for q in llama-8b-Q4_K_M llama-1b-Q4_0 llama-1b-Q4_K_M; do  # the 8b row first: the one furthest from its target
  f=/tmp/gs/$q.gguf; [ -f $f ] || { log "no $f"; continue; }
  tt 90 lb-$q /tmp/gs/build/bin/llama-bench -m $f -ngl 99 -fa on -p 0 -n 128 -d 256 -r 3 -o jsonl
  MB="python3 -m monobatch bench -m $f --device cuda --json --no-progress --weights packed -p 256 -n 128 -r 3"
  MONOBATCH_PACKED_GEMV_CONFIGS=$PWD/src/monobatch/kernels/configs/packed_gemv_NVIDIA_H200.json tt 90 table-$q $MB; MONOBATCH_PACKED_GEMV_CONFIGS= tt 90 rule-$q $MB
  MONOBATCH_PACKED_GEMV=dp4a tt 90 dp4a-$q $MB  # the opt-in dp4a GEMV (int8 activations), every part
done
tail -c 2000 $OUT/err.txt
