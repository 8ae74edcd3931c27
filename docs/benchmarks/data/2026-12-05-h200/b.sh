# call B (2026-12-05): det GLU A/B; llama.cpp + Q4 GGUFs (background); CUDA tests of the FMA min fix; FMA GEMV sweep (llama-1b/8b, M=1) -> tuned table; packed A/B rule vs table; both engines on the Q4 files with the table
source .device/common.sh
GGUF_SHAPES="llama-1b llama-8b" QUANTS="llama-1b:Q4_0 llama-1b:Q4_K_M llama-8b:Q4_K_M" W=/tmp/gs nice -n 19 bash scripts/gpu_serving.sh start $OUT/gs >/dev/null 2>&1
PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests timeout 100 python3 -m pytest -p no:cacheprovider -o addopts="" --tb=short -q tests/test_quant_cuda.py tests/test_invariant_gemm.py -k "compact_is_direct_cuda or tuned or table or glu_linear_cuda" > $OUT/tests.txt 2>&1; log "tests rc=$? $(tail -1 $OUT/tests.txt)"
for r in 1 2; do
tt 25 def-r$r $BL -p 256,8192 -n 128 -r 3
tt 25 det-r$r $BL -p 256,8192 -n 128 -r 3 --deterministic
MONOBATCH_DET_GLU=0 tt 25 det0-r$r $BL -p 256,8192 -n 128 -r 3 --deterministic
done
MONOBATCH_PACKED_GEMV_CONFIGS= PROBE_MS=1 PROBE_TYPES=Q4_0,Q4_K,Q6_K timeout 170 python3 scripts/probe_quant_cuda.py --only bench --shapes llama-8b,llama-1b --sweep-shapes llama-8b,llama-1b --jobs 12 > $OUT/probe.jsonl 2>>$OUT/err.txt; log "probe rc=$? $(grep -c best $OUT/probe.jsonl) best rows"
python3 scripts/packed_gemv_table.py $OUT/probe.jsonl --device "$(python3 -c 'import torch; print(torch.cuda.get_device_name())')" -o $OUT/table.json > $OUT/table.txt 2>&1; tail -1 $OUT/table.txt | tee -a $OUT/log.txt
B8="python3 -m monobatch bench --dummy-weights --shape llama-8b --device cuda --json --no-progress --quant Q4_K -p 256 -n 128 -r 2"
export MONOBATCH_CUDA_PACKED=1
MONOBATCH_PACKED_GEMV_CONFIGS= tt 50 rule8-r1 $B8
MONOBATCH_PACKED_GEMV_CONFIGS=$OUT/table.json tt 50 tab8-r1 $B8
for i in $(seq 40); do [ -f /tmp/gs/build.rc ] && [ -f /tmp/gs/gguf.rc ] && break; sleep 3; done
log "build rc=$(cat /tmp/gs/build.rc 2>/dev/null) gguf rc=$(cat /tmp/gs/gguf.rc 2>/dev/null) $(ls /tmp/gs/*.gguf 2>/dev/null | tr '\n' ' ')"
for q in llama-1b-Q4_0 llama-1b-Q4_K_M llama-8b-Q4_K_M; do
  f=/tmp/gs/$q.gguf; [ -f $f ] || { log "no $f"; continue; }
  timeout 50 /tmp/gs/build/bin/llama-bench -m $f -ngl 99 -fa on -p 0 -n 128 -d 256 -r 3 -o jsonl 2>>$OUT/llama.txt | sed "s/^{/{\"tag\": \"lb-$q\", /" >> $OUT/rows.jsonl
  MONOBATCH_PACKED_GEMV_CONFIGS=$OUT/table.json tt 50 mb-$q python3 -m monobatch bench -m $f --device cuda --json --no-progress --weights packed -p 256 -n 128 -r 3
done
MONOBATCH_PACKED_GEMV_CONFIGS= tt 30 rule1-q40 $BL --quant Q4_0 -p 256 -n 128 -r 2
MONOBATCH_PACKED_GEMV_CONFIGS=$OUT/table.json tt 30 tab1-q40 $BL --quant Q4_0 -p 256 -n 128 -r 2
MONOBATCH_PACKED_GEMV_CONFIGS=$OUT/table.json tt 50 tab8-r2 $B8
MONOBATCH_PACKED_GEMV_CONFIGS= tt 50 rule8-r2 $B8
tail -c 1500 $OUT/err.txt
