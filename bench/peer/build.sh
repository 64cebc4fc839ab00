#!/usr/bin/env bash
# Builds the peer, llama.cpp, from the source that the npm package node-llama-cpp (3.22.1)
# bundles (package/llama/gitRelease.bundle, llama.cpp v0.5.0), in a scratch folder outside the
# repo: no llama.cpp code is kept in combs. Only llama-bench and llama-batched-bench are built
# (and llama-quantize, for quantized test files; llama-speculative, for speculative decoding with
# a draft model, on the GPU).
#
#   bench/peer/build.sh source            # fetch: npm pack + git clone of the bundle into $PEER_DIR/llama.cpp
#   bench/peer/build.sh cpu               # this CPU: GGML_NATIVE=OFF, AVX-512 on, AMX off -> $PEER_DIR/build-cpu/bin
#   bench/peer/build.sh tarball FILE      # the parts a build needs, as FILE (.tar.xz), for the GPU machine
#   bench/peer/build.sh cuda [FILE]       # CUDA sm_90 (on the GPU machine, from FILE when given) -> $PEER_DIR/build-cuda/bin
#
# PEER_DIR defaults to ~/.cache/combs-peer; PEER_TARGETS names the targets to build (default:
# llama-bench llama-batched-bench llama-quantize; e.g. llama-quantize alone for test files). Why these CPU options: llama.cpp built with
# -march=native dies with an illegal instruction in its AMX path on these Xeons, so the ISA
# extensions are named one by one (all that the CPUs have but AMX).
set -euo pipefail
PEER_DIR=${PEER_DIR:-$HOME/.cache/combs-peer}
VERSION=3.22.1
src=$PEER_DIR/llama.cpp
mkdir -p "$PEER_DIR"

fetch() {
  [ -f "$src/CMakeLists.txt" ] && return 0
  command -v npm >/dev/null || { echo "build.sh: npm is needed to fetch node-llama-cpp" >&2; exit 1; }
  (cd "$PEER_DIR" && npm pack --silent "node-llama-cpp@$VERSION" >/dev/null &&
     tar xzf "node-llama-cpp-$VERSION.tgz" package/llama/gitRelease.bundle &&
     git clone -q package/llama/gitRelease.bundle llama.cpp && rm -rf package "node-llama-cpp-$VERSION.tgz")
  echo "build.sh: llama.cpp $(git -C "$src" describe --tags --always 2>/dev/null) in $src"
}

# The options of every build: no tests, examples, server or network code.
common=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF)
targets=(${PEER_TARGETS:-llama-bench llama-batched-bench llama-quantize})
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)

case "${1:-}" in
  source) fetch ;;
  tarball)
    fetch
    out=${2:?usage: build.sh tarball FILE.tar.xz}
    git -C "$src" archive --format=tar HEAD CMakeLists.txt cmake ggml src include common tools examples pocs vendor licenses LICENSE |
      xz -T0 -6 > "$out"
    echo "build.sh: $out ($(du -h "$out" | cut -f1))" ;;
  cpu)
    fetch
    cmake -S "$src" -B "$PEER_DIR/build-cpu" "${generator[@]}" "${common[@]}" \
      -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
      -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF >/dev/null
    cmake --build "$PEER_DIR/build-cpu" -j "$(nproc)" --target "${targets[@]}" >/dev/null
    echo "build.sh: $PEER_DIR/build-cpu/bin: $(ls "$PEER_DIR/build-cpu/bin" | tr '\n' ' ')" ;;
  cuda)
    if [ -n "${2:-}" ] && [ ! -f "$src/CMakeLists.txt" ]; then mkdir -p "$src" && xz -dc "$2" | tar x -C "$src"; fi
    fetch
    nvcc=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
    # Examples configured (llama-speculative is one), only the targets built.
    cmake -S "$src" -B "$PEER_DIR/build-cuda" "${generator[@]}" "${common[@]}" -DLLAMA_BUILD_EXAMPLES=ON -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="$nvcc" >/dev/null
    cmake --build "$PEER_DIR/build-cuda" -j "$(nproc)" --target "${targets[@]}" llama-speculative >/dev/null
    echo "build.sh: $PEER_DIR/build-cuda/bin: $(ls "$PEER_DIR/build-cuda/bin" | tr '\n' ' ')" ;;
  *) sed -n '2,13p' "$0" >&2; exit 2 ;;
esac
