# call 3: the deterministic mode with and without MONOBATCH_DET_GLU=1 beside the default mode (issue 16), check_batching --deterministic with the GLU on llama-1b
source .device/common.sh
[ -d /tmp/site/fastapi ] || { log "no /tmp/site: carry .whl (a fresh machine)"; exit 1; }
for r in 1 2; do
  tt 60 def-r$r $BL -p 256,8192 -n 128 -r 3
  MONOBATCH_DET_GLU=1 tt 60 glu-r$r $BL -p 256,8192 -n 128 -r 3 --deterministic
  tt 60 det-r$r $BL -p 256,8192 -n 128 -r 3 --deterministic
done
MONOBATCH_DET_GLU=1 tt 120 batching-det-glu python3 scripts/check_batching.py --shape llama-1b --device cuda --deterministic  # llama-1b: the GLU applies (the bundled model's 2F = 3,072 splits, so it never runs there)
tail -c 2000 $OUT/err.txt
# + issue 15's constrained ratio on HEAD (n4's head arm; the model from n2's /tmp/stage/00 and the carried .device-parts/1)
if [ -f /tmp/stage/00 ] && [ -f .device-parts/1/part ]; then
  cat /tmp/stage/00 .device-parts/1/part > /tmp/model.gguf; log "model $(sha256sum /tmp/model.gguf | cut -c1-16)"
  tt 90 cons-head-r1 python3 -m monobatch bench -m /tmp/model.gguf --device cuda --json --no-progress --constrained ab -p 128 -n 256 -r 5 --batch-size 1,32
fi
tail -c 1500 $OUT/err.txt
