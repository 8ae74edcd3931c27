# call 1: llama.cpp build + Q4 GGUFs (background, nice 19; nothing below is timed against them); CUDA tests of today's changes
source .device/common.sh
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
GGUF_SHAPES="llama-1b llama-8b" QUANTS="llama-1b:Q4_0 llama-1b:Q4_K_M llama-8b:Q4_K_M" W=/tmp/gs nice -n 19 bash scripts/gpu_serving.sh start $OUT/gs >/dev/null 2>&1
Q=tests/test_quant_cuda.py; I=tests/test_invariant_gemm.py  # node ids: -k "cuda" would match the module's own name
PT="python3 -m pytest -p no:cacheprovider -o addopts= --tb=short -q"
left() { echo $((END - (SECONDS - T0) - ${1:-15})); }  # seconds before the call's deadline, less a margin
# (1) today's kernels first: every compile is new (the GEMV sources changed: Triton's cache keys on them)
PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests timeout 230 $PT $Q::test_dp4a_gemv_cuda $Q::test_dp4a_rows_cuda \
  $Q::test_dp4a_dispatch_cuda $Q::test_compact_is_direct_cuda $I::test_glu_linear_cuda > $OUT/tests1.txt 2>&1
log "tests1 rc=$? $(tail -1 $OUT/tests1.txt)"
PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests timeout 60 python3 docs/benchmarks/data/2026-12-05-next-plan/diag_neg8.py > $OUT/diag.txt 2>&1; log "diag rc=$?"
PYTHONPATH=/tmp/site:$PWD/src timeout 140 python3 scripts/probe_dp4a_gemv.py --budget 100 > $OUT/dp4a.txt 2>&1; log "dp4a rc=$?"
# (2) the rest, in what time is left
PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests timeout $(left 20) $PT $I::test_invariant_gemm_cuda $Q::test_table_configs_cuda \
  $Q::test_fma_gemv_cuda $Q::test_kernels_cuda $Q::test_invariance_cuda $Q::test_graph_replay_cuda $Q::test_packed_weight_cuda \
  $Q::test_dequant_matmul_cuda $Q::test_tiny_gguf_packed_on_cuda $Q::test_model_shapes_cuda > $OUT/tests2.txt 2>&1
log "tests2 rc=$? $(tail -1 $OUT/tests2.txt)"
bash scripts/triton_cache.sh save $OUT
tail -c 2000 $OUT/err.txt
