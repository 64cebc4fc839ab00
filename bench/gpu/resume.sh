#!/bin/bash
# usage (on the GPU machine, through the device tool with carry [".gpu"]):
#   bench/gpu/resume.sh VARIANT "SHAPE:DTYPE ..." LENGTHS ROUNDS [tests]
#   e.g. bench/gpu/resume.sh main "llama-1b:bf16 llama-8b:bf16" 1000,4000 5 tests
# With "tests", the variant's [cuda] tests first; then `combs-bench resume --device cuda` (an
# evicted session brought back through the host tier vs by recompute) for each model, with Llama
# 3's vocabulary. Each report is also written to $OUT/resume-SHAPE-DTYPE.md.
set -u
V=$1; MODELS=$2; LENGTHS=$3; ROUNDS=$4
. "$(dirname "$0")/unpack.sh" $V
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
if [ "${5:-}" = tests ] && [ -x /tmp/bin/$V/combs_cuda_tests ]; then
  echo "== [cuda] tests of $V"
  timeout 300 /tmp/bin/$V/combs_cuda_tests > "${OUT:-/tmp}/cuda-tests-$V.log" 2>&1
  echo "exit $?"; grep -E "tier|us/token" "${OUT:-/tmp}/cuda-tests-$V.log" | head -5; tail -4 "${OUT:-/tmp}/cuda-tests-$V.log"
fi
for m in $MODELS; do
  shape=${m%%:*}; dtype=${m##*:}
  echo "== resume $shape $dtype"
  timeout 400 /tmp/bin/$V/combs-bench resume --device cuda --shape "$shape" --dtype "$dtype" \
    --vocab tests/data/vocab/ggml-vocab-llama-bpe.gguf --dir /tmp/models --lengths "$LENGTHS" --rounds "$ROUNDS" \
    2>&1 | tee "${OUT:-/tmp}/resume-$shape-$dtype.md"
done
