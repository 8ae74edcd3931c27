# call 1: llama.cpp build + GGUFs in the background; the decode attention sweep
# carry: .whl .llama-cpp
set -x
mkdir -p /tmp/stage
GGUF_SHAPES="llama-1b llama-8b" QUANTS="llama-1b:Q4_0 llama-1b:Q4_K_M llama-8b:Q4_K_M" W=/tmp/gs bash scripts/gpu_serving.sh start $OUT/gs
export PYTHONPATH=/tmp/site:$PWD/src
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 450 python3 scripts/bench_decode_attention.py --ctx 256,1024,8192 > $OUT/attn.jsonl 2> $OUT/attn.err
tail -3 /tmp/gs/build.log > $OUT/build_tail.txt 2>&1; ls -la /tmp/gs >> $OUT/build_tail.txt
