#!/bin/bash
# Call 3: every [cuda] test at aba3ffc (the switches removed).
set -u
. bench/gpu/unpack.sh final
O=${OUT:-/tmp}; t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $O/log.txt
/tmp/bin/final/combs_cuda_tests "[cuda]" -d yes > $O/cuda-tests.log 2>&1; echo "# $(( $(date +%s) - t0 )) s: cuda tests rc $?" | tee -a $O/log.txt
tail -3 $O/cuda-tests.log | tee -a $O/log.txt
grep -B2 -A14 "FAILED" $O/cuda-tests.log | head -60 | tee -a $O/log.txt
