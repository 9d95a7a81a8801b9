#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the llama-cpp-python source distribution on PyPI
# (it vendors llama.cpp under vendor/llama.cpp), for the single-user speed comparison in
# docs/benchmarks.md. cmake and a C++ compiler are needed; neither is a dependency of pagedllm,
# and CI does not run this script.
#
# Usage: benchmarks/build_llama_server.sh [BUILD_ROOT] [VERSION]
#   BUILD_ROOT  where to download and build (default /work/tools-build; keep it outside the repo)
#   VERSION     llama-cpp-python version (default: the newest sdist pip finds)
# Env: JOBS (parallel compile jobs, default 2).
# Prints the path of the built binary on its last line.
set -euo pipefail

BUILD_ROOT="${1:-/work/tools-build}"
VERSION="${2:-}"
JOBS="${JOBS:-2}"

mkdir -p "$BUILD_ROOT/sdist"
cd "$BUILD_ROOT"

SPEC="llama-cpp-python"
if [[ -n "$VERSION" ]]; then SPEC="llama-cpp-python==$VERSION"; fi

if ! ls sdist/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
  python -m pip download --no-deps --no-binary :all: -d sdist "$SPEC"
fi
TARBALL="$(ls sdist/llama_cpp_python-*.tar.gz | sort -V | tail -n 1)"
SRC_DIR="$BUILD_ROOT/$(basename "$TARBALL" .tar.gz)"
if [[ ! -d "$SRC_DIR" ]]; then
  tar -xzf "$TARBALL" -C "$BUILD_ROOT"
fi
LLAMA_DIR="$SRC_DIR/vendor/llama.cpp"
if [[ ! -f "$LLAMA_DIR/CMakeLists.txt" ]]; then
  echo "no vendored llama.cpp in $SRC_DIR" >&2
  exit 1
fi

# Native CPU build (GGML_NATIVE picks up AVX-512 / AMX where the CPU has them); no CUDA, no curl.
cmake -S "$LLAMA_DIR" -B "$LLAMA_DIR/build" \
  -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON
cmake --build "$LLAMA_DIR/build" --target llama-server -j "$JOBS"

BIN="$(find "$LLAMA_DIR/build" -name llama-server -type f -perm -u+x | head -n 1)"
if [[ -z "$BIN" ]]; then
  echo "llama-server was not built" >&2
  exit 1
fi
echo "$BIN"
