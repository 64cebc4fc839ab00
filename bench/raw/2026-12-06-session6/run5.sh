#!/bin/bash
# Call 5 (session 6): quant_imma's offsets from x's unit sums behind a temporary switch
# (COMBS_IMMA_SUMS=1). The quantized tests and the unit sums' test with it on; then the 8-bit batch
# kernel alone (bench/gpu/qgemv.cu, llama-8b's matrices, 64 and 32 rows of x), off / on alternated.
set -u
. bench/gpu/unpack.sh sums
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))"; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $O/log.txt
COMBS_IMMA_SUMS=1 timeout 200 /tmp/bin/sums/combs_cuda_tests "[quant],x rounded to 8 bits in groups of 256*,a norm rounded to 8 bits*" -d yes > $O/cuda-tests-sums.log 2>&1; echo "# $(el) s: tests (sums on) rc $?" | tee -a $O/log.txt
tail -3 $O/cuda-tests-sums.log | tee -a $O/log.txt
grep -B2 -A14 "FAILED" $O/cuda-tests-sums.log | head -40 | tee -a $O/log.txt
for n in 64 64 32; do
  for s in 0 1; do
    echo "## sums $s n $n ($(el) s)" | tee -a $O/log.txt
    COMBS_IMMA_SUMS=$s timeout 90 /tmp/bin/sums/qgemv 20 imma $n 2>&1 | tee -a $O/log.txt
  done
done
echo "# end $(el) s"
