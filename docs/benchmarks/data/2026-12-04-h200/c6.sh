# lease 3, call 6: the bundled model; constrained ab, two processes; parity of the json config (deterministic) if time is left
cat /tmp/stage/00 .device-parts/1/part > /tmp/model.gguf
source .device/common.sh
sha256sum /tmp/model.gguf | tee -a $OUT/log.txt
for r in 1 2; do
  tt 120 cons-ab-r$r python3 -m monobatch bench -m /tmp/model.gguf --device cuda --json --no-progress --constrained ab -p 128 -n 256 -r 5 --batch-size 1,32
done
tt 120 parity-json python3 -m monobatch parity -m /tmp/model.gguf --device cuda --configs json --no-progress --deterministic --expect-identical --json $OUT/parity-json.json
tail -c 1500 $OUT/err.txt
