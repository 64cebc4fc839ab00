#!/bin/bash
# usage (on the GPU machine, through the device tool with carry [".gpu"]):
#   bench/gpu/spec.sh VARIANT "SHAPE:DTYPE ..." MAX_DRAFT ROUNDS [tests]
#   e.g. bench/gpu/spec.sh main "llama-1b:bf16 llama-8b:bf16" 4 3 tests
# With "tests", the variant's [cuda] tests first; then `combs-bench spec --device cuda` (one
# session's decode with speculation across draft acceptance, against without) for each model,
# with Llama 3's vocabulary. Each report is also written to $OUT/spec-SHAPE-DTYPE.md.
set -u
V=$1; MODELS=$2; MAX_DRAFT=$3; ROUNDS=$4
. "$(dirname "$0")/unpack.sh" $V
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
if [ "${5:-}" = tests ] && [ -x /tmp/bin/$V/combs_cuda_tests ]; then
  echo "== [cuda] tests of $V"
  timeout 300 /tmp/bin/$V/combs_cuda_tests > "${OUT:-/tmp}/cuda-tests-$V.log" 2>&1
  echo "exit $?"; tail -4 "${OUT:-/tmp}/cuda-tests-$V.log"
fi
for m in $MODELS; do
  shape=${m%%:*}; dtype=${m##*:}
  echo "== spec $shape $dtype"
  timeout 300 /tmp/bin/$V/combs-bench spec --device cuda --shape "$shape" --dtype "$dtype" \
    --vocab tests/data/vocab/ggml-vocab-llama-bpe.gguf --dir /tmp/models --max-draft "$MAX_DRAFT" --rounds "$ROUNDS" \
    2>&1 | tee "${OUT:-/tmp}/spec-$shape-$dtype.md"
done
