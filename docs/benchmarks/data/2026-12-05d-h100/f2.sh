# final call B: the bundled model, packed (dp4a and fma GEMV) against dequantized, greedy on CUDA; parity of packed dp4a in the default mode
source .device/common.sh
cat /tmp/stage/00 .device-parts/1/part > /tmp/model.gguf; log "model $(sha256sum /tmp/model.gguf | cut -c1-16)"
for v in dp4a fma; do
  MONOBATCH_CUDA_PACKED=1 MONOBATCH_PACKED_GEMV=$v timeout 60 python3 scripts/compare_devices.py --model /tmp/model.gguf -n 64 --a cuda:bfloat16:dequant --b cuda:bfloat16:packed > $OUT/cmp-$v.txt 2>>$OUT/err.txt; log "cmp $v rc=$?"
done
MONOBATCH_CUDA_PACKED=1 MONOBATCH_PACKED_GEMV=dp4a timeout 120 python3 -m monobatch parity -m /tmp/model.gguf --device cuda --weights packed > $OUT/parity-dp4a.txt 2>&1; log "parity dp4a rc=$?"
tail -c 1500 $OUT/err.txt
