#!/usr/bin/env bash
# Triton's compiled kernels kept from one device machine to the next. A fresh H200 compiles every
# kernel of the engine in its first processes (the first `bench` or test run of a session has
# run out of 120-170 s limits on that alone; docs/benchmarks, 2026-12-03), and each session starts
# a fresh machine. Triton looks its kernels up on disk by the kernel's source, the Triton version,
# the target (cuda:90) and the specialisation, so a cache written on one H200 serves another with
# the same software; a changed kernel is simply compiled again.
#
# On the device (the repository root; .triton-cache/ carried when you have one):
#   source scripts/triton_cache.sh restore       # TRITON_CACHE_DIR=/tmp/triton-cache, unpacked from
#                                                # .triton-cache/cache.tar.gz when that was carried
#   ... the session's runs ...
#   bash scripts/triton_cache.sh save "$OUT"     # $OUT/triton-cache.tar.gz (left out when > 15 MiB)
# Here, after that call:
#   mkdir -p .triton-cache && cp FILES_AT/triton-cache.tar.gz .triton-cache/cache.tar.gz
# and name ".triton-cache" in the next calls' `carry` (it is git-ignored).
# (no `set` here: `restore` is sourced into the caller's shell)
CACHE=${TRITON_CACHE_DIR:-/tmp/triton-cache}
case "${1:-}" in
  restore)
    export TRITON_CACHE_DIR=$CACHE
    mkdir -p "$CACHE"
    if [ -f .triton-cache/cache.tar.gz ]; then
      tar -xzf .triton-cache/cache.tar.gz -C "$CACHE" && echo "triton cache: $(find "$CACHE" -name '*.cubin' | wc -l) kernels restored"
    fi ;;
  save)
    out=${2:?usage: triton_cache.sh save OUT_DIR}
    tar -czf "$out/triton-cache.tar.gz" -C "$CACHE" . || exit 1
    size=$(stat -c %s "$out/triton-cache.tar.gz")
    if [ "$size" -gt $((15 << 20)) ]; then
      echo "triton cache: $size bytes, over the 15 MiB a returned file may have: not kept"; rm -f "$out/triton-cache.tar.gz"
    else
      echo "triton cache: $(find "$CACHE" -name '*.cubin' | wc -l) kernels, $size bytes in $out/triton-cache.tar.gz"
    fi ;;
  *) echo "usage: source scripts/triton_cache.sh restore | bash scripts/triton_cache.sh save OUT_DIR" >&2
     return 2 2>/dev/null || exit 2 ;;
esac
