#!/bin/bash
# usage (on the GPU machine, after bench/gpu/ab.sh "VARIANTS" SHAPE ONLY 0 unpacked the builds):
#   bench/gpu/specs.sh ROUNDS SHAPES ONLY "VARIANT:ENV=V,ENV2=W VARIANT2: ..."
#   e.g. bench/gpu/specs.sh 2 llama-1b,llama-8b decode "main: next:COMBS_X=1 next:COMBS_X=2"
# The rounds of ab.sh (which runs this for them), with environment settings (experiment switches)
# per build, alternating in one machine session: ROUNDS rounds of `combs-bench gpu --shapes S
# --only ONLY --reps 3` per spec and shape (DTYPES=q4_k_m,...: those weight types, models written once).
set -u
ROUNDS=$1; SHAPES=$2; ONLY=$3; SPECS=$4
export LD_LIBRARY_PATH=$PWD/.gpu/libs:/tmp/gpulibs:/usr/local/cuda/lib64
VOCAB=$PWD/tests/data/vocab/ggml-vocab-llama-bpe.gguf  # the real shapes: Llama 3's 128,256 tokens
for r in $(seq "$ROUNDS"); do
  for spec in $SPECS; do
    v=${spec%%:*}; e=${spec#*:}
    for s in ${SHAPES//,/ }; do
      echo "== round $r $spec $(env ${e//,/ } /tmp/bin/$v/combs-bench gpu --shapes $s --only $ONLY --reps 3 ${DTYPES:+--dtypes $DTYPES} --vocab "$VOCAB" 2>&1 | grep -v '^#' | grep -v '^$' | tr '\n' ' ')"
    done
  done
done
