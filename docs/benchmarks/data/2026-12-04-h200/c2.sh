# call 2: assemble the bundled model; det A/B (HEAD default, HEAD det, fz det when FZ=1); constrained ab; batched total beside llama-batched-bench
cat /tmp/stage/00 .device-parts/1/part > /tmp/model.gguf
source .device/common.sh
sha256sum /tmp/model.gguf | tee -a $OUT/log.txt
(cd /tmp/fz && PYTHONPATH=/tmp/site:/tmp/fz/src:/tmp/fz/tests timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_kernels.py tests/test_varlen_attention.py tests/test_kv_paged.py -k 'cuda or captured or graph' > $OUT/fz-tests.txt 2>&1; echo rc=$? >> $OUT/fz-tests.txt); log "fz tests $(tail -2 $OUT/fz-tests.txt | tr '\n' ' ')"
# the build and GGUFs (background since call 1) must be done before anything is timed
for i in $(seq 60); do [ -f /tmp/gs/build.rc ] && [ -f /tmp/gs/gguf.rc ] && break; sleep 5; done
log "build rc=$(cat /tmp/gs/build.rc 2>/dev/null) gguf rc=$(cat /tmp/gs/gguf.rc 2>/dev/null) $(ls /tmp/gs/*.gguf | tr '\n' ' ')"
for r in 1 2; do
  tt 80 def-r$r $BL -p 256,8192 -n 128 -r 3
  tt 80 det-r$r $BL -p 256,8192 -n 128 -r 3 --deterministic
  [ "${FZ:-0}" = 1 ] && PYTHONPATH=/tmp/site:/tmp/fz/src tt 80 fzdet-r$r $BL -p 256,8192 -n 128 -r 3 --deterministic
done
tt 150 cons-ab python3 -m monobatch bench -m /tmp/model.gguf --device cuda --json --no-progress --constrained ab -p 128 -n 256 -r 5 --batch-size 1,32
BIN=/tmp/gs/build/bin
for rep in 1 2; do
  timeout 90 $BIN/llama-batched-bench -m /tmp/gs/llama-1b-f16.gguf -ngl 99 -fa on -c 131072 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 64,128,256 --output-format jsonl 2>>$OUT/llama.txt | sed "s/^{/{\"tag\": \"bb-f16-$rep\", /" >> $OUT/rows.jsonl; log "bb rep $rep"
  tt 90 batched-r$rep $BL -p 128 -n 128 -r 2 --batch-size 64,128,256
done
tt 60 det-b64 $BL -p 128 -n 128 -r 1 --batch-size 64 --deterministic
tail -c 2500 $OUT/err.txt
