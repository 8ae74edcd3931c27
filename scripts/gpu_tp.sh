#!/usr/bin/env bash
# Issue 19's GPU measurements on an nvidia-h200-x2 (2 GPUs; device tool, repo root). NOT RUN YET:
# no multi-GPU kind was lent in the session that wrote it (ADR 0007, "Not run").
#   1. correctness over NCCL: the TP unit tests on this host, and `monobatch parity -tp 2
#      --deterministic --expect-identical` on CUDA (the bundled model, if installed)
#   2. llama-8b shape, bf16, random weights: B=1 decode (and TTFT at 256) and B=64 batched
#      throughput at TP=1 (CUDA graphs, and --enforce-eager: TP=2 runs without graphs) and TP=2
#   3. TODO (commands below, commented): llama.cpp `--split-mode row` vs `none` on the same F16 GGUF
#      (needs the CUDA llama.cpp build of scripts/gpu_serving.sh's build phase)
# Targets (issue 19): TP=2 >= 1.6x TP=1 decode throughput at B=64; TP=2 >= 1.2x llama.cpp row-split at B=1.
# Expected time: ~8-10 min on a fresh machine (8B random init on the GPU, 6 bench calls).
# Usage: bash scripts/gpu_tp.sh OUTDIR      Outputs: OUTDIR/{log,tests,parity}.txt, OUTDIR/{check_tp,bench}.jsonl
set -u
OUT=${1:?OUTDIR}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
export MONOBATCH_TP_TIMEOUT=${MONOBATCH_TP_TIMEOUT:-120}
nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv > "$OUT/log.txt"
nvidia-smi topo -m >> "$OUT/log.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())" >> "$OUT/log.txt" 2>&1

# 1. correctness
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py 2>&1 | tail -15 > "$OUT/tests.txt"
for mode in "" "--deterministic"; do  # NCCL: TP=2 vs TP=1 tokens and logits on random weights (no model file needed)
  timeout 240 python3 scripts/check_tp.py --shape llama-1b --device cuda --tp 2 $mode >> "$OUT/check_tp.jsonl" 2>> "$OUT/log.txt" \
    || echo "check_tp $mode rc=$?" >> "$OUT/log.txt"
done
if python3 -c "from monobatch.loader import bundled_model_path as p; assert p()" 2>/dev/null; then
  timeout 300 python3 -m monobatch parity --device cuda -tp 2 --deterministic --expect-identical --configs greedy,seeded \
      -n 32 --json "$OUT/parity.json" > "$OUT/parity.txt" 2>&1; echo "parity rc=$?" >> "$OUT/parity.txt"
else
  echo "no bundled model: parity skipped" > "$OUT/parity.txt"
fi

# 2. monobatch, llama-8b shape bf16: B=1 (decode, TTFT 256) and B=64 (batched throughput)
B="timeout 150 python3 -m monobatch bench --dummy-weights --shape llama-8b --device cuda --dtype bfloat16 --json --no-progress"
for tp in "" "--enforce-eager" "-tp 2"; do
  $B $tp -p 256 -n 128 -r 3 >> "$OUT/bench.jsonl" 2>> "$OUT/log.txt" || echo "B=1 $tp failed rc=$?" >> "$OUT/log.txt"
  $B $tp -p 128 -n 128 -r 1 --batch-size 64 >> "$OUT/bench.jsonl" 2>> "$OUT/log.txt" || echo "B=64 $tp failed rc=$?" >> "$OUT/log.txt"
done

# the deterministic mode's pieces at TP=1 (ADR 0007), beside issue 16's llama-1b --deterministic numbers
timeout 150 python3 -m monobatch bench --dummy-weights --shape llama-1b --device cuda --json --no-progress \
    --deterministic -p 256 -n 128 -r 2 >> "$OUT/bench.jsonl" 2>> "$OUT/log.txt" || echo "llama-1b det failed" >> "$OUT/log.txt"

# 3. TODO llama.cpp --split-mode row beside it (same call, same F16 GGUF), once a CUDA build exists:
#   python3 scripts/write_shape_gguf.py --shape llama-8b -o /tmp/llama-8b-f16.gguf --tokenizer-from <bundled gguf>
#   $BIN/llama-bench -m /tmp/llama-8b-f16.gguf -ngl 99 -fa on -sm none -p 256 -n 128 -r 3 -o jsonl >> "$OUT/llama_cpp.jsonl"
#   $BIN/llama-bench -m /tmp/llama-8b-f16.gguf -ngl 99 -fa on -sm row  -p 256 -n 128 -r 3 -o jsonl >> "$OUT/llama_cpp.jsonl"
#   $BIN/llama-batched-bench -m /tmp/llama-8b-f16.gguf -ngl 99 -fa on -sm row -npp 128 -ntg 128 -npl 64 >> "$OUT/llama_cpp.txt"
echo done >> "$OUT/log.txt"
