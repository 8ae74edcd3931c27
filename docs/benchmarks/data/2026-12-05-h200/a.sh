# call A (2026-12-05): the compact-vs-direct CUDA test's failure in full; one decode step's GPU timeline: default, deterministic, packed Q4_0 / Q4_K (1b), Q4_K (8b)
source .device/common.sh
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests timeout 150 python3 -m pytest -x -p no:cacheprovider -o addopts="" --tb=long -q tests/test_quant_cuda.py -k "compact_is_direct_cuda" > $OUT/compact.txt 2>&1; log "compact rc=$?"
P="python3 scripts/profile_decode.py --no-profile -n 48"
tt 50 def $P --shape llama-1b --trace /tmp/def.json
tt 50 det $P --shape llama-1b --deterministic --trace /tmp/det.json
MONOBATCH_CUDA_PACKED=1 tt 60 q40 $P --shape llama-1b --quant Q4_0 --trace /tmp/q40.json
MONOBATCH_CUDA_PACKED=1 tt 60 q4k $P --shape llama-1b --quant Q4_K --trace /tmp/q4k.json
MONOBATCH_CUDA_PACKED=1 tt 90 q4k8 $P --shape llama-8b --quant Q4_K --trace /tmp/q4k8.json
tail -c 2000 $OUT/err.txt
