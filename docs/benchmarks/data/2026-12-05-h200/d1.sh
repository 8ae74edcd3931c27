# call 1: wheels, llama.cpp build + GGUFs (nice 19, background), the packed CUDA tests, random-weight packed benches
source .device/common.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $OUT/gpu.txt; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt
GGUF_SHAPES="llama-1b llama-8b" QUANTS="llama-1b:Q4_0 llama-1b:Q4_K_M llama-8b:Q4_K_M" W=/tmp/gs nice -n 19 bash scripts/gpu_serving.sh start $OUT/gs >/dev/null 2>&1
PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests timeout 260 python3 -m pytest -q -p no:cacheprovider tests/test_quant_cuda.py -k "cuda or sm90 or repack or dequantize or compact" > $OUT/qtests.txt 2>&1; log "qtests rc=$? $(tail -1 $OUT/qtests.txt)"
for r in 1 2; do
MONOBATCH_CUDA_PACKED=1 tt 90 q40-r$r $BL --quant Q4_0 -p 256 -n 128 -r 2
MONOBATCH_CUDA_PACKED=1 tt 90 q4k-r$r $BL --quant Q4_K -p 256 -n 128 -r 2
tt 60 bf16-r$r $BL -p 256 -n 128 -r 2
done
bash scripts/triton_cache.sh save $OUT
{ tail -2 /tmp/gs/build.log; cat /tmp/gs/build.rc /tmp/gs/gguf.rc; ls -la /tmp/gs; tail -5 /tmp/gs/gguf.log; } > $OUT/gs.txt 2>&1
tail -c 3000 $OUT/err.txt
