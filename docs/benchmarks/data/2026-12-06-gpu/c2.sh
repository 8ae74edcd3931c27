# call 8 (short, END ~260): MONOBATCH_PDL_TRIGGER wait / small / all at llama-8b Q4_K (random packed): traces, a second round, then
# and llama-1b bf16 (profile_decode: tok/s, forward GPU ms, the tokens' digest; one trace each at 8b), then the
# CUDA tests of the kernels this session changed under the most eager trigger, and check_batching
source .device/common.sh
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
export MONOBATCH_CUDA_PACKED=1
mkdir -p /tmp/gs
P="python3 scripts/profile_decode.py --no-profile -n 64"
pr() { local tag=$1; shift; local t1=$SECONDS; local left=$((END - (SECONDS - T0) - 10)); ((left < 20)) && { log "SKIP $tag"; return; }
  timeout $((left < 90 ? left : 90)) "$@" > $OUT/$tag.txt 2>>$OUT/err.txt; log "rc=$? $((SECONDS-t1))s $tag $(tail -1 $OUT/$tag.txt | cut -c1-200)"; }
for m in wait small all; do MONOBATCH_PDL_TRIGGER=$m pr 8b-$m-trace $P --shape llama-8b --quant Q4_K --trace /tmp/gs/t-$m.json; gzip -c /tmp/gs/t-$m.json > $OUT/trace-8b-$m.json.gz; done
for m in all small wait; do MONOBATCH_PDL_TRIGGER=$m pr 8b-$m-r2 $P --shape llama-8b --quant Q4_K; done
MONOBATCH_PDL_TRIGGER=all PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests timeout 90 python3 -m pytest -p no:cacheprovider -o addopts= --tb=short -q \
  tests/test_decode_graphs.py tests/test_kv_window.py -k "cuda" > $OUT/tests.txt 2>&1; log "tests rc=$? $(tail -1 $OUT/tests.txt)"
MONOBATCH_PDL_TRIGGER=all pr check-all python3 scripts/check_batching.py --shape llama-1b --device cuda
tail -c 1000 $OUT/err.txt
