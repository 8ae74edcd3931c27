# call 3 (at once after m2, same machine): issue 16's serving rounds (bench-serve against llama-server
# -np 64 -cb and monobatch serve, same GGUF) and the monobatch bench rounds with a null arm
source .device/common.sh
log "build rc=$(cat /tmp/gs/build.rc 2>/dev/null) gguf rc=$(cat /tmp/gs/gguf.rc 2>/dev/null)"
W=/tmp/gs STEPS="serve rounds" ROUNDS=2 SERVE_ROUNDS=1 PROMPTS=300 BUDGET=$((END - (SECONDS - T0) - 10)) bash scripts/gpu_serving.sh bench $OUT/s16 > /dev/null 2>&1
log "done"
tail -c 1000 $OUT/err.txt
