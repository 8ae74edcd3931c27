# call 4 (if device time is left): the bundled model: constrained A/B of HEAD and HEAD + the 410fe00 host-path patch (issue 15)
[ -f /tmp/stage/00 ] || { echo "no /tmp/stage/00: run n2 first on this machine"; exit 1; }
cat /tmp/stage/00 .device-parts/1/part > /tmp/model.gguf
source .device/common.sh
[ -d /tmp/site/fastapi ] || { log "no /tmp/site: carry .whl (a fresh machine)"; exit 1; }
mkdir -p /tmp/alt && cp -r src /tmp/alt/ && P=$PWD; (cd /tmp/alt && git apply --include='src/*' $P/docs/benchmarks/data/2026-12-04-cpu-constrained-host/410fe00-host-path.patch) && log "patch applied" || { log "the patch does not apply: no cons-410 rows"; exit 1; }
CB="python3 -m monobatch bench -m /tmp/model.gguf --device cuda --json --no-progress --constrained ab -p 128 -n 256 -r 5 --batch-size 1,32"
for r in 1 2; do tt 60 cons-head-r$r $CB; PYTHONPATH=/tmp/site:/tmp/alt/src tt 60 cons-410-r$r $CB; done
tail -c 2000 $OUT/err.txt
