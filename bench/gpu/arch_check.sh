#!/bin/bash
# usage (on the GPU machine, through the device tool with carry [".gpu"]): bench/gpu/arch_check.sh [VARIANT]
# The [cuda] tests of VARIANT (bench/gpu/pack.sh), then every architecture's logits against
# transformers (tests/reference/compare_hf_archs.sh) with its combs-mkmodel and combs-generate.
set -u
V=${1:-main}
. "$(dirname "$0")/unpack.sh" $V
echo "== cuda tests"
timeout 400 /tmp/bin/$V/combs_cuda_tests "${TESTS:-[cuda]}" 2>&1 | tail -n "${TAIL:-40}"
echo "== transformers"
timeout 300 bash tests/reference/compare_hf_archs.sh /tmp/bin/$V
