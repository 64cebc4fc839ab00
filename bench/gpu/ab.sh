#!/bin/bash
# usage (on the GPU machine, through the device tool with carry [".gpu"]):
#   bench/gpu/ab.sh "VARIANTS" SHAPES ONLY ROUNDS [tests]
#   e.g. bench/gpu/ab.sh "main next" llama-1b,llama-8b decode 3 tests
# Runs the [cuda] tests of each variant (with "tests"), then ROUNDS rounds of
# `combs-bench gpu --shapes S --only ONLY --reps 3` alternating the variants packed by pack.sh:
# A/B figures from one machine session, the only comparison these noisy machines allow.
set -u
VARIANTS=$1; SHAPES=$2; ONLY=$3; ROUNDS=$4
. "$(dirname "$0")/unpack.sh" $VARIANTS
if [ "${5:-}" = tests ]; then
  for v in $VARIANTS; do
    [ -x /tmp/bin/$v/combs_cuda_tests ] || continue
    echo "== tests $v"; timeout 300 /tmp/bin/$v/combs_cuda_tests 2>&1 | tail -4
  done
fi
# The rounds: specs.sh with each variant as it is (no environment settings).
bash "$(dirname "$0")/specs.sh" "$ROUNDS" "$SHAPES" "$ONLY" "$(for v in $VARIANTS; do printf '%s: ' "$v"; done)"
