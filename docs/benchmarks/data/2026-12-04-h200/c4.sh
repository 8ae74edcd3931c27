# lease 2: the tree = HEAD + the RoPE/KV-store fusion + SwiGLU's gate in the invariant GEMM (decode rows)
source .device/common.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $OUT/gpu.txt
python3 scripts/write_shape_gguf.py --shape smollm2-135m -o /tmp/s.gguf --tokenizer-from .device/tok/smollm2-tokenizer.gguf > $OUT/gguf.txt 2>&1 &
GP=$!
PYTHONPATH=$PYTHONPATH:$PWD/tests timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_invariant_gemm.py tests/test_kernels.py -k "cuda" > $OUT/tests.txt 2>&1; log "tests rc=$? $(tail -1 $OUT/tests.txt)"
for r in 1 2; do
  tt 90 def-r$r $BL -p 256,8192 -n 128 -r 3
  tt 90 det-r$r $BL -p 256,8192 -n 128 -r 3 --deterministic
  MONOBATCH_DET_GATED_MAX_M=0 tt 90 detng-r$r $BL -p 256,8192 -n 128 -r 3 --deterministic
done
for r in 1 2; do
  tt 60 b64def-r$r $BL -p 128 -n 128 -r 2 --batch-size 64
  tt 60 b64det-r$r $BL -p 128 -n 128 -r 2 --batch-size 64 --deterministic
  MONOBATCH_DET_GATED_MAX_M=64 tt 60 b64det64-r$r $BL -p 128 -n 128 -r 2 --batch-size 64 --deterministic
done
wait $GP; log "gguf $(tail -1 $OUT/gguf.txt)"
tt 200 parity-det python3 -m monobatch parity -m /tmp/s.gguf --device cuda --configs json,greedy --no-progress --deterministic --expect-identical --json $OUT/parity-det.json
bash scripts/triton_cache.sh save $OUT
tail -c 2000 $OUT/err.txt
