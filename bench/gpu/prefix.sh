#!/bin/bash
# usage (on the GPU machine, through the device tool with carry [".gpu"]):
#   bench/gpu/prefix.sh VARIANT "SHAPE:DTYPE ..." ROUNDS [tests]
#   e.g. bench/gpu/prefix.sh main "llama-8b:bf16 llama-8b:q4_k_m" 1 tests
# With "tests", the variant's [cuda] tests first; then `combs-bench prefix --device cuda` (64
# sessions sharing a 2,048-token system prompt, 64 own tokens each, 128 generated; prefix cache
# off / cold / warm, and nothing shared on vs off) for each model, with Llama 3's vocabulary.
# Each report is also written to $OUT/prefix-SHAPE-DTYPE.md.
set -u
V=$1; MODELS=$2; ROUNDS=$3
. "$(dirname "$0")/unpack.sh" $V
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
if [ "${4:-}" = tests ] && [ -x /tmp/bin/$V/combs_cuda_tests ]; then
  echo "== [cuda] tests of $V"
  timeout 240 /tmp/bin/$V/combs_cuda_tests > "${OUT:-/tmp}/cuda-tests-$V.log" 2>&1
  echo "exit $?"; tail -4 "${OUT:-/tmp}/cuda-tests-$V.log"
fi
for m in $MODELS; do
  shape=${m%%:*}; dtype=${m##*:}
  echo "== prefix $shape $dtype"
  timeout 420 /tmp/bin/$V/combs-bench prefix --device cuda --shape "$shape" --dtype "$dtype" \
    --vocab tests/data/vocab/ggml-vocab-llama-bpe.gguf --dir /tmp/models --rounds "$ROUNDS" \
    2>&1 | tee "${OUT:-/tmp}/prefix-$shape-$dtype.md"
done
