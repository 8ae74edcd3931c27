#!/usr/bin/env bash
# A trimmed llama.cpp source tarball for the GPU machine (scripts/gpu_serving.sh builds it there).
#
# Takes llama.cpp from the PyPI sdist of llama-cpp-python (vendor/llama.cpp; 0.3.36 vendors
# commit 0c1e570, the one of the earlier side-by-side runs), drops what no build of llama-bench,
# llama-batched-bench, llama-server or llama-quantize needs (docs/, models/ = vocab GGUFs,
# media/, examples/, tests/, benches/, pocs/, gguf-py/, the web UI's sources and test assets,
# the server's Python tests), and packs the rest into OUTDIR/llama.cpp.tar.gz (~7 MiB; the
# device tool carries at most 64 MiB). tools/ui keeps its CMake files: llama-server's build
# needs them, and with -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF it embeds no UI (no npm,
# no download). Build the tree with -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF.
#
# Usage: bash scripts/llama_cpp_src.sh [OUTDIR]      (default .llama-cpp, git-ignored)
#   env: PIP (default .venv/bin/pip), PY (default .venv/bin/python), LLAMA_CPP_PYTHON_VERSION (default 0.3.36; "latest" = newest),
#        SDIST_CACHE (where the 73 MiB sdist is kept between runs; default /tmp/llama-cpp-sdist)
#   CHECK=1 also configures the unpacked tarball for this CPU with -DLLAMA_BUILD_SERVER=ON
#   (cmake only, no build), to prove the trimmed tree is complete.
# Writes OUTDIR/llama.cpp.tar.gz (top folder llama.cpp/), OUTDIR/VERSION and OUTDIR/smollm2-tokenizer.gguf
# (scripts/write_shape_gguf.py --tokenizer-only with PY, default .venv/bin/python: the bundled model's
# tokenizer fields, which the GPU machine needs to write the shapes' GGUFs); prints the tarball's path last.
set -euo pipefail
OUT=${1:-.llama-cpp}
PIP=${PIP:-.venv/bin/pip}
VER=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CACHE=${SDIST_CACHE:-/tmp/llama-cpp-sdist}
spec=llama-cpp-python; [ "$VER" = latest ] || spec="llama-cpp-python==$VER"
mkdir -p "$OUT" "$CACHE"
sdist=$(ls "$CACHE"/llama_cpp_python-"${VER/latest/*}".tar.gz 2>/dev/null | tail -1 || true)
if [ -z "$sdist" ] || [ "$VER" = latest ]; then
  "$PIP" download -q --no-deps --no-binary :all: "$spec" -d "$CACHE"
  sdist=$(ls -t "$CACHE"/llama_cpp_python-*.tar.gz | head -1)
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
top=$(basename "$sdist" .tar.gz)
tar -xzf "$sdist" -C "$work" "$top/vendor/llama.cpp"
src="$work/$top/vendor/llama.cpp"
( cd "$src"
  rm -rf docs models media examples tests benches pocs gguf-py \
         tools/ui/src tools/ui/static tools/ui/tests tools/ui/package-lock.json \
         tools/server/tests tools/server/bench tools/mtmd/test-1.jpeg tools/mtmd/test-2.mp3 tools/mtmd/test-3.mp4
  for f in CMakeLists.txt cmake/build-info.cmake scripts/ui-assets.cmake tools/ui/CMakeLists.txt \
           tools/ui/ui.cpp.in tools/ui/ui.h.in tools/server/CMakeLists.txt tools/batched-bench/CMakeLists.txt \
           tools/llama-bench/CMakeLists.txt tools/quantize/CMakeLists.txt ggml/src/ggml-cuda/CMakeLists.txt; do
    [ -f "$f" ] || { echo "llama_cpp_src.sh: $f missing from $top's llama.cpp" >&2; exit 1; }
  done )
mv "$src" "$work/llama.cpp"
tar -czf "$OUT/llama.cpp.tar.gz" -C "$work" llama.cpp
printf 'llama-cpp-python %s (sdist %s), vendor/llama.cpp, trimmed by scripts/llama_cpp_src.sh\n' \
  "${top#llama_cpp_python-}" "$(basename "$sdist")" > "$OUT/VERSION"
if [ "${CHECK:-0}" = 1 ]; then
  chk="$work/check"; mkdir -p "$chk"
  tar -xzf "$OUT/llama.cpp.tar.gz" -C "$chk"
  cmake -S "$chk/llama.cpp" -B "$chk/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF > "$chk/configure.log" 2>&1 \
    || { tail -30 "$chk/configure.log" >&2; exit 1; }
  echo "llama_cpp_src.sh: cmake configure of the trimmed tree (-DLLAMA_BUILD_SERVER=ON) ok" >&2
fi
# the tokenizer the shapes' GGUFs need (the 12 tokenizer fields of the bundled SmolLM2 GGUF, ~2 MiB)
"${PY:-.venv/bin/python}" scripts/write_shape_gguf.py --tokenizer-only -o "$OUT/smollm2-tokenizer.gguf" >&2
du -h "$OUT"/* >&2
echo "$OUT/llama.cpp.tar.gz"
