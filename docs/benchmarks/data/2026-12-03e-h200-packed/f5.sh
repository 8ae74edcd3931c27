set -u
O=$1; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
B="python3 -m monobatch bench --dummy-weights --device cuda --json --no-progress --shape llama-1b -n 128"
run() { tag=$1; shift; echo "{\"tag\": \"$tag\"}" >> $O/ab.jsonl; timeout 60 "$@" >> $O/ab.jsonl 2>> $O/ab.err || echo "fail $tag" >> $O/ab.err; }
run "dense p256" $B -p 256 -r 3
MONOBATCH_CUDA_PACKED=1 run "q4_0 p256" $B -p 256 -r 3 --quant Q4_0
MONOBATCH_CUDA_PACKED=1 run "q4_0 b64" $B -p 128 -r 1 --batch-size 64 --quant Q4_0
run "dense b64" $B -p 128 -r 1 --batch-size 64
MONOBATCH_CUDA_PACKED=1 MONOBATCH_PACKED_DEQUANT_M=100000 run "q4_0 b64 gemm" $B -p 128 -r 1 --batch-size 64 --quant Q4_0
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_quant_cuda.py tests/test_decode_graphs.py -k "cuda and not model_forward" > $O/tests.txt 2>&1; echo "tests $?" >> $O/ab.err
