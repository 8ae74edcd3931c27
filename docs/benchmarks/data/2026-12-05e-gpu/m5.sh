# call 5 (short; no llama.cpp; END ~300): the DP4A sweep at llama-8b's Q4_K products with the pipelined tiles, merged into
# the packaged table of this GPU; one 8b decode step (random packed Q4_K weights) with that table, with the
# packaged one and with the rule, and its GPU timeline
source .device/common.sh
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); TB=src/monobatch/kernels/configs/packed_gemv_${GPU// /_}.json
export MONOBATCH_CUDA_PACKED=1
mkdir -p /tmp/gs
PROBE_MS=1,4 PROBE_TYPES=Q4_K PROBE_REP=10 timeout 80 python3 scripts/probe_quant_cuda.py --variant dp4a --only bench --shapes llama-8b --sweep-shapes llama-8b > $OUT/sweep-8b.jsonl 2>>$OUT/err.txt; log "sweep rc=$?"
rm -f /tmp/gs/table.json; [ -f $TB ] && cp $TB /tmp/gs/table.json
python3 scripts/packed_gemv_table.py $OUT/sweep-8b.jsonl --device "$GPU" -o /tmp/gs/table.json > $OUT/table.txt 2>&1; log "table rc=$? $(tail -1 $OUT/table.txt)"
cp /tmp/gs/table.json $OUT/table.json
P="python3 scripts/profile_decode.py --shape llama-8b --quant Q4_K --no-profile -n 32"
MONOBATCH_PACKED_GEMV_CONFIGS=/tmp/gs/table.json tt 45 new $P --trace /tmp/gs/q4k8.json
# the packaged tables' tiles and entries (the H100's DP4A entries at M = 1 and 4) and the merged table's, on the GPU
MONOBATCH_PACKED_GEMV_CONFIGS=/tmp/gs/table.json PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests timeout $((END - (SECONDS - T0) - 10)) \
  python3 -m pytest -p no:cacheprovider -o addopts= --tb=short -q -v tests/test_quant_cuda.py::test_table_configs_cuda \
  tests/test_quant_cuda.py::test_dp4a_rows_cuda > $OUT/tests.txt 2>&1; log "tests rc=$? $(tail -1 $OUT/tests.txt)"
tail -c 1000 $OUT/err.txt
