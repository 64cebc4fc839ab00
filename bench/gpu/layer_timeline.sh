#!/bin/bash
# usage (on the GPU machine, through the device tool with carry [".gpu"]):
#   bench/gpu/layer_timeline.sh VARIANT [LAYERS] [WHAT...]
# Kernel timelines (bench/gpu/timeline.cc) of VARIANT's one-session steps on the qwen3-30b-a3b
# shape's first LAYERS layers (default 2) in Q4_K_M with Qwen2's vocabulary (written to /dev/shm
# once by VARIANT's combs-mkmodel): for each WHAT (default: decode sampled), `combs-bench gpu
# --only WHAT`, then timeline.py's table of kernels by their increments. No tests, no peer: the
# quick look at where a layer's time goes before and after a change.
set -u
V=${1:?variant}; LAYERS=${2:-2}; shift; shift
WHAT=${*:-decode sampled}
here=$(cd "$(dirname "$0")" && pwd); repo=$(cd "$here/../.." && pwd)
cd "$repo"
. bench/gpu/unpack.sh "$V"
mkdir -p /tmp/vocab && tar xJf tests/data/vocab/more-vocabs.tar.xz -C /tmp/vocab ggml-vocab-qwen2.gguf
m=/dev/shm/qwen3-30b-a3b-${LAYERS}l-q4_k_m.gguf
[ -s "$m" ] || /tmp/bin/$V/combs-mkmodel --shape qwen3-30b-a3b --layers "$LAYERS" --dtype q4_k_m \
  --vocab /tmp/vocab/ggml-vocab-qwen2.gguf --out "$m" > /dev/null
[ -s /tmp/libtimeline.so ] || g++ -O2 -shared -fPIC -I/usr/local/cuda/include "$here/timeline.cc" -o /tmp/libtimeline.so \
  -L/usr/local/cuda/lib64 -lcupti
for w in $WHAT; do
  echo "## $V $w ($LAYERS layers)"
  CUDA_INJECTION64_PATH=/tmp/libtimeline.so COMBS_TIMELINE=/tmp/t-$w.csv /tmp/bin/$V/combs-bench gpu --models "$m" \
    --vocab none --reps 1 --only "$w" 2>&1 | tail -n 1
  python3 "$here/timeline.py" /tmp/t-$w.csv 2>&1 | head -n 40
done
