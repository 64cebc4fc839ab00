#!/bin/bash
# usage (on the GPU machine, through the device tool with carry [".gpu"]):
#   bench/gpu/moe_layers.sh OLD NEW [LAYERS]
# A mixture of experts' layer timed without writing the 18 GB file: the qwen3-30b-a3b shape's first
# LAYERS (default 2) layers in Q4_K_M (Qwen2's vocabulary) written to /dev/shm by NEW's
# combs-mkmodel, then NEW's [cuda] tests, combs-bench gpu's table for OLD and NEW alternated (two
# rounds), and a kernel timeline of NEW's decode (bench/gpu/timeline.cc). OLD and NEW: variants
# packed by pack.sh (.gpu/VARIANT). Not a comparison with the peer (moe.sh is): a before/after.
set -u
OLD=${1:?old variant}; NEW=${2:?new variant}; LAYERS=${3:-2}
here=$(cd "$(dirname "$0")" && pwd); repo=$(cd "$here/../.." && pwd)
cd "$repo"
. bench/gpu/unpack.sh "$OLD" "$NEW"
t0=$(date +%s)
mkdir -p /tmp/vocab && tar xJf tests/data/vocab/more-vocabs.tar.xz -C /tmp/vocab ggml-vocab-qwen2.gguf
m=/dev/shm/qwen3-30b-a3b-${LAYERS}l-q4_k_m.gguf
/tmp/bin/$NEW/combs-mkmodel --shape qwen3-30b-a3b --layers "$LAYERS" --dtype q4_k_m --vocab /tmp/vocab/ggml-vocab-qwen2.gguf --out "$m" &
mk=$!
/tmp/bin/$NEW/combs_cuda_tests "[cuda]" 2>&1 | tail -n "${TAIL:-6}"
echo "# tests done after $(( $(date +%s) - t0 )) s"
wait $mk; ls -la "$m"; echo "# model after $(( $(date +%s) - t0 )) s"
for r in 1 2; do
  for v in "$OLD" "$NEW"; do
    echo "## $v round $r"
    # --vocab none: the file carries its vocabulary; no attention table (its rows would come last)
    /tmp/bin/$v/combs-bench gpu --models "$m" --vocab none --reps 3 --sessions 64 --attention-contexts "" 2>&1 | tail -n 2
  done
done
echo "# tables done after $(( $(date +%s) - t0 )) s"
g++ -O2 -shared -fPIC -I/usr/local/cuda/include "$here/timeline.cc" -o /tmp/libtimeline.so -L/usr/local/cuda/lib64 -lcupti &&
  CUDA_INJECTION64_PATH=/tmp/libtimeline.so COMBS_TIMELINE=/tmp/t.csv /tmp/bin/$NEW/combs-bench gpu --models "$m" --vocab none --reps 1 --only decode 2>&1 | tail -n 2
python3 "$here/timeline.py" /tmp/t.csv --layer 1 2>&1 | tail -n 40
echo "# done after $(( $(date +%s) - t0 )) s"
