# call 2: the Q4 files on both engines (llama-1b Q4_0, Q4_K_M; llama-8b Q4_K_M), packed vs dequant on llama-1b Q4_K_M
mkdir -p /tmp/stage && cp .device-parts/0/part /tmp/stage/00
source .device/common.sh
for i in $(seq 60); do [ -f /tmp/gs/build.rc ] && [ -f /tmp/gs/gguf.rc ] && break; sleep 5; done
log "build rc=$(cat /tmp/gs/build.rc 2>/dev/null) gguf rc=$(cat /tmp/gs/gguf.rc 2>/dev/null) $(ls /tmp/gs/*.gguf | tr '\n' ' ')"
BIN=/tmp/gs/build/bin
for q in llama-1b-Q4_0 llama-1b-Q4_K_M llama-8b-Q4_K_M; do
  f=/tmp/gs/$q.gguf; [ -f $f ] || { log "no $f"; continue; }
  ls -la $f >> $OUT/log.txt
  timeout 90 $BIN/llama-bench -m $f -ngl 99 -fa on -p 2048 -n 0 -r 3 -o jsonl 2>>$OUT/llama.txt | sed "s/^{/{\"tag\": \"lb-$q\", /" >> $OUT/rows.jsonl
  timeout 90 $BIN/llama-bench -m $f -ngl 99 -fa on -p 0 -n 128 -d 256 -r 3 -o jsonl 2>>$OUT/llama.txt | sed "s/^{/{\"tag\": \"lb-$q\", /" >> $OUT/rows.jsonl
  log "llama-bench $q"
  MONOBATCH_CUDA_PACKED=1 tt $([ $q = llama-8b-Q4_K_M ] && echo 200 || echo 80) mb-$q python3 -m monobatch bench -m $f --device cuda --json --no-progress --weights packed -p 256,2048 -n 128 -r 3
done
f=/tmp/gs/llama-1b-Q4_K_M.gguf
tt 70 dq-1b-Q4_K_M python3 -m monobatch bench -m $f --device cuda --json --no-progress --weights dequant -p 256,2048 -n 128 -r 3
MONOBATCH_CUDA_PACKED=1 tt 60 pk-b64 python3 -m monobatch bench -m $f --device cuda --json --no-progress --weights packed -p 128 -n 128 -r 2 --batch-size 64
tt 60 dq-b64 python3 -m monobatch bench -m $f --device cuda --json --no-progress --weights dequant -p 128 -n 128 -r 2 --batch-size 64
tail -c 2500 $OUT/err.txt
