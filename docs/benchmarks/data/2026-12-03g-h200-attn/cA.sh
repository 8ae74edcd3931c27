# call A: llama.cpp build + GGUFs in the background; CUDA tests of the changed kernels; det/default A/B (tree vs .base = HEAD's src)
# carry: .whl .llama-cpp .base
mkdir -p /tmp/stage
GGUF_SHAPES="llama-1b llama-8b" QUANTS="llama-1b:Q4_0 llama-1b:Q4_K_M llama-8b:Q4_K_M" W=/tmp/gs bash scripts/gpu_serving.sh start $OUT/gs
export PYTHONPATH=/tmp/site:$PWD/src
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpu.txt
PYTHONPATH=$PYTHONPATH:$PWD/tests timeout 230 python3 -m pytest -q -p no:cacheprovider -x tests/test_kernels.py tests/test_varlen_attention.py tests/test_kv_paged.py tests/test_quant_cuda.py -k "cuda or captured or graph" > $OUT/tests.txt 2>&1; tail -3 $OUT/tests.txt
B="python3 -m monobatch bench --dummy-weights --shape llama-1b --device cuda --json --no-progress -p 256,8192 -n 128 -r 2"
for r in 1 2; do
  for arm in new base; do
    P=$PWD/src; [ $arm = base ] && P=$PWD/.base/src
    for mode in det def; do
      F=; [ $mode = det ] && F=--deterministic
      PYTHONPATH=/tmp/site:$P timeout 100 $B $F 2>>$OUT/ab.err | sed "s/^{/{\"arm\": \"$arm-$mode\", \"round\": $r, /" >> $OUT/ab.jsonl
    done
  done
done
tail -3 /tmp/gs/build.log > $OUT/build_tail.txt 2>&1; ls -la /tmp/gs >> $OUT/build_tail.txt
