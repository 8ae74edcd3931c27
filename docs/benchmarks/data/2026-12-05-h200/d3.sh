# call 3: assemble the bundled model; constrained ab; det vs default A/B; parity --deterministic on packed CUDA weights
cat /tmp/stage/00 .device-parts/1/part > /tmp/model.gguf
source .device/common.sh
sha256sum /tmp/model.gguf | tee -a $OUT/log.txt
tt 160 cons-ab python3 -m monobatch bench -m /tmp/model.gguf --device cuda --json --no-progress --constrained ab -p 128 -n 256 -r 5 --batch-size 1,32
for r in 1 2; do
  tt 75 def-r$r $BL -p 256,8192 -n 128 -r 3
  tt 75 det-r$r $BL -p 256,8192 -n 128 -r 3 --deterministic
done
MONOBATCH_CUDA_PACKED=1 tt 170 parity-det-packed python3 -m monobatch parity -m /tmp/model.gguf --device cuda --weights packed --configs json,greedy --no-progress --deterministic --expect-identical --json $OUT/parity-det-packed.json
tail -c 2500 $OUT/err.txt
