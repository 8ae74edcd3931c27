#!/usr/bin/env bash
# Quick A/B of B=1 decode settings on the device (repo root): the kernel tests, then
# scripts/profile_decode.py --no-profile per (shape, prompt, setting), interleaved ROUNDS times (default 2); one
# JSON line each (step wall and forward GPU ms medians). Settings are profile_decode.py --set
# overrides ("-" = defaults).
# Usage: bash scripts/ab_decode.sh OUTDIR "SHAPE:PROMPT" ... -- "SETTING" ...
set -u
OUT=${1:?OUTDIR}; shift
mkdir -p "$OUT"
python3 -c "import gguf, fastapi, uvicorn" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
CASES=(); SETS=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do CASES+=("$1"); shift; done
[ $# -gt 0 ] && shift
SETS=("$@"); [ ${#SETS[@]} -eq 0 ] && SETS=("-")
for round in $(seq 1 ${ROUNDS:-2}); do
    for case in "${CASES[@]}"; do
        for set in "${SETS[@]}"; do
            args=(); [ "$set" != "-" ] && for s in $set; do args+=(--set "$s"); done
            timeout 120 python3 scripts/profile_decode.py --no-profile --shape "${case%%:*}" -p "${case##*:}" -n 128 "${args[@]}" \
                2>>"$OUT/ab_stderr.txt" | tail -1 | tee -a "$OUT/ab.jsonl"
        done
    done
done
