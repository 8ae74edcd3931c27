#!/bin/bash
# Peak RSS of `monobatch generate` (GNU time's %M, KiB), packed vs dequant, interleaved rounds.
# usage (repository root): bash docs/benchmarks/data/2026-12-03b-cpu-rss/rounds.sh OUT.txt [ROUNDS] [BASE_SRC]
#   BASE_SRC: the src folder of another commit's tree (git archive d00da19 src | tar -x -C /tmp/base:
#   /tmp/base/src); its arms run with PYTHONPATH=BASE_SRC, in the same rounds, after this tree's.
set -u
out=$(realpath "$1"); rounds=${2:-3}; base=${3:-}
P=$(.venv/bin/python -c "import random; from monobatch.synth import synth_text; print(synth_text(random.Random(0), 100))")
: > "$out"
for r in $(seq "$rounds"); do
  for arm in new ${base:+base}; do
    for w in packed dequant; do
      pp=; [ "$arm" = base ] && pp=$base
      PYTHONPATH=$pp /usr/bin/time -a -o "$out" -f "$r $arm $w %M" .venv/bin/monobatch generate -t 2 --weights $w \
        -n 128 --temperature 0 --ignore-eos --output-format json -p "$P" > /dev/null 2> /dev/null
    done
  done
done
cat "$out"
