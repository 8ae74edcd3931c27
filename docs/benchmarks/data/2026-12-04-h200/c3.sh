# call 3: the Q4 files on both engines (llama-1b Q4_0, Q4_K_M; llama-8b Q4_K_M), parity --deterministic on the H200
source .device/common.sh
BIN=/tmp/gs/build/bin
for q in llama-1b-Q4_0 llama-1b-Q4_K_M llama-8b-Q4_K_M; do
  f=/tmp/gs/$q.gguf; [ -f $f ] || { log "no $f"; continue; }
  timeout 90 $BIN/llama-bench -m $f -ngl 99 -fa on -p 2048 -n 0 -r 3 -o jsonl 2>>$OUT/llama.txt | sed "s/^{/{\"tag\": \"lb-$q\", /" >> $OUT/rows.jsonl
  timeout 90 $BIN/llama-bench -m $f -ngl 99 -fa on -p 0 -n 128 -d 256 -r 3 -o jsonl 2>>$OUT/llama.txt | sed "s/^{/{\"tag\": \"lb-$q\", /" >> $OUT/rows.jsonl
  log "llama-bench $q"
  MONOBATCH_CUDA_PACKED=1 tt $([ $q = llama-8b-Q4_K_M ] && echo 200 || echo 80) mb-$q python3 -m monobatch bench -m $f --device cuda --json --no-progress --weights packed -p 256,2048 -n 128 -r 3
done
PYTHONPATH=/tmp/site:/tmp/fz/src tt 170 parity-det-fz python3 -m monobatch parity -m /tmp/model.gguf --device cuda --configs json,greedy --no-progress --deterministic --expect-identical --json $OUT/parity-det.json
(cd /tmp/fz && PYTHONPATH=/tmp/site:/tmp/fz/src:/tmp/fz/tests timeout 120 python3 -m pytest -v -p no:cacheprovider -x --timeout 45 tests/test_varlen_attention.py tests/test_kv_paged.py tests/test_kernels.py -k "cuda or captured or graph" > $OUT/fz-tests.txt 2>&1)
tail -c 2500 $OUT/err.txt
