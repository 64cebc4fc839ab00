#!/bin/bash
set -u
. bench/gpu/unpack.sh tp
O=${OUT:-/tmp}; t0=$(date +%s)
/tmp/bin/tp/combs_cuda_tests "[cuda]" -d yes > $O/cuda-tests.log 2>&1; echo "tests rc $? ($(( $(date +%s) - t0 )) s)"
grep -E "FAILED" -A16 $O/cuda-tests.log | head -60; tail -2 $O/cuda-tests.log
