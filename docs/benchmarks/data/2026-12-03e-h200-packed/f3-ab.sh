# call 3 (commit f1cb8c0, MIN_PART default 256 then): llama.cpp build + GGUFs started in the background, then A/B rounds
set -u
O=$1; mkdir -p $O
GGUF_SHAPES="llama-1b" QUANTS="llama-1b:Q4_0 llama-1b:Q4_K_M" W=/tmp/gs bash scripts/gpu_serving.sh start $O/s > $O/start.txt 2>&1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
B="python3 -m monobatch bench --dummy-weights --device cuda --json --no-progress --shape llama-1b -n 128"
run() { tag=$1; shift; echo "{\"tag\": \"$tag\"}" >> $O/ab.jsonl; timeout 90 "$@" >> $O/ab.jsonl 2>> $O/ab.err || echo "fail $tag" >> $O/ab.err; }
for r in 1 2; do
  run "dense p256 min256 r$r" $B -p 256 -r 3
  MONOBATCH_DECODE_MIN_PART=64 run "dense p256 min64 r$r" $B -p 256 -r 3
  MONOBATCH_CUDA_PACKED=1 run "q4_0 p256 min256 r$r" $B -p 256 -r 3 --quant Q4_0
  MONOBATCH_CUDA_PACKED=1 MONOBATCH_DECODE_MIN_PART=64 run "q4_0 p256 min64 r$r" $B -p 256 -r 3 --quant Q4_0
  MONOBATCH_CUDA_PACKED=1 run "q4_k p256 min256 r$r" $B -p 256 -r 3 --quant Q4_K
done
run "dense p8192 min256" $B -p 8192 -r 2
MONOBATCH_DECODE_MIN_PART=64 run "dense p8192 min64" $B -p 8192 -r 2
MONOBATCH_DECODE_MIN_PART=512 run "dense p256 min512" $B -p 256 -r 3
MONOBATCH_DECODE_MIN_PART=1024 run "dense p1024 min1024" $B -p 1024 -r 2
run "dense p1024 min256" $B -p 1024 -r 2
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_decode_graphs.py -k "cuda" > $O/tests.txt 2>&1; echo "tests $?" >> $O/ab.err
