# call 1: llama.cpp + GGUFs in the background (nice 19); the DP4A GEMV's configs swept at llama-8b's and
# llama-1b's products (M = 1) -> a tuned table for this GPU (/tmp/gs/table.json, merged into the packaged
# one of this GPU if there is one); then the CUDA tests with dp4a the default and that table installed
source .device/common.sh
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); TB=src/monobatch/kernels/configs/packed_gemv_${GPU// /_}.json
GGUF_SHAPES="llama-1b smollm2-135m llama-8b" QUANTS="llama-1b:Q4_0 llama-1b:Q4_K_M llama-8b:Q4_K_M" W=/tmp/gs nice -n 19 bash scripts/gpu_serving.sh start $OUT/gs >/dev/null 2>&1
export MONOBATCH_CUDA_PACKED=1
PR="python3 scripts/probe_quant_cuda.py --variant dp4a --only bench"
PROBE_MS=1 PROBE_TYPES=Q4_K,Q6_K PROBE_REP=10 timeout 230 $PR --shapes llama-8b --sweep-shapes llama-8b > $OUT/sweep-8b.jsonl 2>>$OUT/err.txt; log "sweep 8b rc=$?"
PROBE_MS=1 PROBE_TYPES=Q4_0,Q4_K,Q6_K PROBE_REP=10 timeout 130 $PR --shapes llama-1b --sweep-shapes llama-1b > $OUT/sweep-1b.jsonl 2>>$OUT/err.txt; log "sweep 1b rc=$?"
[ -f $TB ] && cp $TB /tmp/gs/table.json
cat $OUT/sweep-8b.jsonl $OUT/sweep-1b.jsonl > /tmp/gs/sweep.jsonl
python3 scripts/packed_gemv_table.py /tmp/gs/sweep.jsonl --device "$GPU" --merge -o /tmp/gs/table.json > $OUT/table.txt 2>&1; log "table rc=$? $(tail -1 $OUT/table.txt)"
cp /tmp/gs/table.json $OUT/table.json
export MONOBATCH_PACKED_GEMV_CONFIGS=/tmp/gs/table.json
Q=tests/test_quant_cuda.py; I=tests/test_invariant_gemm.py
PT="python3 -m pytest -p no:cacheprovider -o addopts= --tb=short -q"
left() { echo $((END - (SECONDS - T0) - ${1:-15})); }
PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests timeout $(left 20) $PT $Q::test_table_configs_cuda $Q::test_dp4a_rows_cuda \
  $Q::test_dp4a_dispatch_cuda $Q::test_dp4a_gemv_cuda $Q::test_tiny_gguf_packed_on_cuda $Q::test_model_shapes_cuda \
  $Q::test_graph_replay_cuda $Q::test_packed_weight_cuda $Q::test_invariance_cuda $Q::test_kernels_cuda \
  $I::test_invariant_gemm_cuda $Q::test_dequant_matmul_cuda $Q::test_fma_gemv_cuda > $OUT/tests.txt 2>&1
log "tests rc=$? $(tail -1 $OUT/tests.txt)"
log "build $(cat /tmp/gs/build.rc 2>/dev/null || echo running) gguf $(cat /tmp/gs/gguf.rc 2>/dev/null || echo running); $(ls /tmp/gs/*.gguf 2>/dev/null | xargs -n1 basename | tr '\n' ' ')"
bash scripts/triton_cache.sh save $OUT
tail -c 1500 $OUT/err.txt
