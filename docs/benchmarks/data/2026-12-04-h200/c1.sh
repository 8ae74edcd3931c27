# call 1: wheels, part 0, llama.cpp build + GGUFs (nice 19, background), warm compiles, the fusion tree under faulthandler
mkdir -p /tmp/stage && cp .device-parts/0/part /tmp/stage/00
source .device/common.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $OUT/gpu.txt; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt
GGUF_SHAPES="llama-1b llama-8b" QUANTS="llama-1b:Q4_0 llama-1b:Q4_K_M llama-8b:Q4_K_M" W=/tmp/gs nice -n 19 bash scripts/gpu_serving.sh start $OUT/gs >/dev/null 2>&1
R=$PWD; rm -rf /tmp/fz && mkdir -p /tmp/fz && cp -r src tests /tmp/fz/ && (cd /tmp/fz && patch -p1 -s < $R/docs/benchmarks/data/2026-12-03g-h200-attn/rope-store-fusion.patch) && log "fz tree ready"
tt 260 head-det $BL -p 256,8192 -n 128 -r 2 --deterministic
SIG=ABRT PYTHONFAULTHANDLER=1 PYTHONPATH=/tmp/site:/tmp/fz/src tt 150 fz-det $BL -p 256,8192 -n 128 -r 2 --deterministic
tt 120 head-def $BL -p 256,8192 -n 128 -r 2
SIG=ABRT PYTHONFAULTHANDLER=1 PYTHONPATH=/tmp/site:/tmp/fz/src tt 100 fz-def $BL -p 256,8192 -n 128 -r 2
MONOBATCH_CUDA_PACKED=1 tt 100 warm-q40 $BL --quant Q4_0 -p 256 -n 32 -r 1
tt 90 warm-smol python3 -m monobatch bench --dummy-weights --shape smollm2-135m --device cuda --json --no-progress -p 128 -n 64 --batch-size 1,32 -r 1
bash scripts/triton_cache.sh save $OUT
{ tail -2 /tmp/gs/build.log; cat /tmp/gs/build.rc /tmp/gs/gguf.rc; ls -la /tmp/gs; cat /tmp/gs/gguf.log; } > $OUT/gs.txt 2>&1
tail -c 3000 $OUT/err.txt
