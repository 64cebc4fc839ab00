#!/bin/bash
# [cuda] tests; quant_imma against quant_mma (n 64, 16).
set -u
. bench/gpu/unpack.sh tp
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
xz -dc .gpu/qgemv.xz > /tmp/qgemv && chmod +x /tmp/qgemv
for n in 64 16; do
  timeout 100 /tmp/qgemv 10 imma $n > $O/qgemv-imma-$n.log 2>&1; echo "qgemv $n rc $? ($(el))"
  awk -F'\t' '$2 ~ /imma/ {print $1, $2, $3, $5, $7, $8}' $O/qgemv-imma-$n.log | awk 'NR%3==2'
done
/tmp/bin/tp/combs_cuda_tests "[cuda]" -d yes > $O/cuda-tests.log 2>&1; echo "tests rc $? ($(el))" | tee -a $O/log.txt
grep -E "FAILED" -A16 $O/cuda-tests.log | head -60; tail -2 $O/cuda-tests.log
