# call 5 (short; no llama.cpp): the DP4A sweep at llama-8b's Q4_K products with the pipelined tiles, merged into
# the packaged table of this GPU; one 8b decode step (random packed Q4_K weights) with that table, with the
# packaged one and with the rule, and its GPU timeline
source .device/common.sh
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); TB=src/monobatch/kernels/configs/packed_gemv_${GPU// /_}.json
export MONOBATCH_CUDA_PACKED=1
mkdir -p /tmp/gs
PROBE_MS=1 PROBE_TYPES=Q4_K PROBE_REP=10 timeout 130 python3 scripts/probe_quant_cuda.py --variant dp4a --only bench --shapes llama-8b --sweep-shapes llama-8b > $OUT/sweep-8b.jsonl 2>>$OUT/err.txt; log "sweep rc=$?"
rm -f /tmp/gs/table.json; [ -f $TB ] && cp $TB /tmp/gs/table.json
python3 scripts/packed_gemv_table.py $OUT/sweep-8b.jsonl --device "$GPU" --merge -o /tmp/gs/table.json > $OUT/table.txt 2>&1; log "table rc=$? $(tail -1 $OUT/table.txt)"
cp /tmp/gs/table.json $OUT/table.json
P="python3 scripts/profile_decode.py --shape llama-8b --quant Q4_K --no-profile -n 32"
MONOBATCH_PACKED_GEMV_CONFIGS=/tmp/gs/table.json tt 45 new $P --trace /tmp/gs/q4k8.json
tt 35 packaged $P
MONOBATCH_PACKED_GEMV_CONFIGS= tt 35 rule $P
tail -c 1000 $OUT/err.txt
