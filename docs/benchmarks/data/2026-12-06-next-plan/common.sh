# sourced by each call: env, the deadline helper, tagging
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
[ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
source scripts/triton_cache.sh restore
T0=$SECONDS; END=${END:-560}
log() { echo "[$(date -u +%H:%M:%S) +$((SECONDS-T0))s] $*" | tee -a $OUT/log.txt; }
# tt WANT TAG CMD...: CMD under timeout (trimmed to the call's END), stdout's JSON lines tagged into $OUT/rows.jsonl (other lines dropped)
tt() { local want=$1 tag=$2; shift 2; local left=$((END - (SECONDS - T0) - 10)); ((left < want)) && want=$left
  if ((want < 20)); then log "SKIP $tag"; return 124; fi
  local t1=$SECONDS; timeout -k 5 -s ${SIG:-TERM} $want "$@" 2>>$OUT/err.txt | grep --line-buffered '^{' | sed -u "s/^{/{\"tag\": \"$tag\", /" >> $OUT/rows.jsonl
  local rc=${PIPESTATUS[0]}; log "rc=$rc $((SECONDS-t1))s $tag"; return $rc; }
BL="python3 -m monobatch bench --dummy-weights --shape llama-1b --device cuda --json --no-progress"
