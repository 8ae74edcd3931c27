# call 3: the deterministic mode with and without MONOBATCH_DET_GLU=1 beside the default mode (issue 16), check_batching --deterministic with the GLU on llama-1b
source .device/common.sh
[ -d /tmp/site/fastapi ] || { log "no /tmp/site: carry .whl (a fresh machine)"; exit 1; }
for r in 1 2; do
  tt 60 def-r$r $BL -p 256,8192 -n 128 -r 3
  MONOBATCH_DET_GLU=1 tt 60 glu-r$r $BL -p 256,8192 -n 128 -r 3 --deterministic
  tt 60 det-r$r $BL -p 256,8192 -n 128 -r 3 --deterministic
done
MONOBATCH_DET_GLU=1 tt 150 batching-det-glu python3 scripts/check_batching.py --shape llama-1b --device cuda --deterministic  # llama-1b: the GLU applies (the bundled model's 2F = 3,072 splits, so it never runs there)
tail -c 2000 $OUT/err.txt
