# call C: assemble the bundled model; packed vs dequant on it; parity; llama.cpp beside monobatch on the llama-1b Q4 files
# carry: .device-parts/0
cat .device-parts/0/part /tmp/stage/01 > /tmp/model.gguf && ls -la /tmp/model.gguf
export PYTHONPATH=/tmp/site:$PWD/src
B="python3 -m monobatch bench -m /tmp/model.gguf --device cuda --json --no-progress -p 128 -n 128 -r 3 --batch-size 1,32"
for r in 1; do for w in packed dequant; do
  timeout 80 $B --weights $w 2>>$OUT/bundled.err | sed "s/^{/{\"arm\": \"$w\", \"round\": $r, /" >> $OUT/bundled.jsonl
done; done
timeout 150 python3 -m monobatch parity -m /tmp/model.gguf --device cuda --configs json,greedy --deterministic --expect-identical > $OUT/parity-det.txt 2>&1; echo "parity rc=$?" >> $OUT/parity-det.txt; tail -4 $OUT/parity-det.txt
cat /tmp/gs/build.rc /tmp/gs/gguf.rc; ls /tmp/gs
STEPS=packed PACKED_ARMS=packed QUANTS="llama-1b:Q4_0 llama-1b:Q4_K_M llama-8b:Q4_K_M" BUDGET=330 W=/tmp/gs bash scripts/gpu_serving.sh bench $OUT/p1 > /dev/null 2>&1; tail -5 $OUT/p1/log.txt
