#!/usr/bin/env bash
# Fetch llama.cpp (vendored by the PyPI sdist of llama-cpp-python) and build llama-bench and
# llama-quantize for this machine's CPU (-DGGML_NATIVE=ON). The source and the build live
# outside the repository.   Usage: bash scripts/build_llama_cpp.sh [DIR]   (default /tmp/llama-cpp)
# Prints the directory holding the binaries (DIR/build/bin) on its last line.
set -eu
D=${1:-/tmp/llama-cpp}
PIP=${PIP:-.venv/bin/pip}
mkdir -p "$D"
if [ ! -f "$D/src/CMakeLists.txt" ]; then
  "$PIP" download -q --no-deps --no-binary :all: llama-cpp-python -d "$D/sdist"
  rm -rf "$D/unpacked" && mkdir -p "$D/unpacked"
  tar -xzf "$D"/sdist/llama_cpp_python-*.tar.gz -C "$D/unpacked"
  rm -rf "$D/src" && mv "$D"/unpacked/llama_cpp_python-*/vendor/llama.cpp "$D/src"
fi
if [ ! -x "$D/build/bin/llama-bench" ] || [ ! -x "$D/build/bin/llama-quantize" ]; then
  cmake -S "$D/src" -B "$D/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
  cmake --build "$D/build" --target llama-bench llama-quantize -j "$(nproc)" >/dev/null
fi
echo "$D/build/bin"
