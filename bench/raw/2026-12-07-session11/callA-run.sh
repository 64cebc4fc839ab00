#!/bin/bash
# For the next session (branch wip/q4k-pairs): one call. Carry [".gpu/libs", ".gpu/qp", ".gpu/main10",
# ".gpu/voc"] with tests/data/vocab's four large files moved out (.gpu/voc holds Llama 3's vocabulary
# compressed; restore the files before any build). .gpu/qp: the branch's combs-bench and
# combs_cuda_tests (built at 37258ce, the same kernel code as the branch's head); .gpu/main10: main's
# combs-bench (c24a4f6). Every [cuda] test of the branch (the new invariance and 4,096-wide pair
# cases among them) while llama-8b Q4_K_M is written; then one session's decode and 4 and 8
# sessions (2-8 rows through the decode kernel), main and the branch alternated, two rounds.
set -u
repo=$PWD
xz -dc .gpu/voc/ggml-vocab-llama-bpe.gguf.xz > tests/data/vocab/ggml-vocab-llama-bpe.gguf
. bench/gpu/unpack.sh qp main10
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))"; }
out=/tmp/qp; mkdir -p $out
models=/dev/shm/combs-models; mkdir -p $models
W=/tmp/bin/qp/combs-bench; M=/tmp/bin/main10/combs-bench
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $O/log.txt
( $W gpu --only models --shapes llama-8b --dtypes q4_k_m --dir $models --vocab $repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf > $out/models.txt 2> $out/models.log; echo $? > $out/models.rc ) &
/tmp/bin/qp/combs_cuda_tests "[cuda]" > $O/cuda-tests.log 2>&1; echo "# $(el) s: cuda tests rc $?" | tee -a $O/log.txt
tail -2 $O/cuda-tests.log | tee -a $O/log.txt
grep -B3 -A10 "FAILED" $O/cuda-tests.log | head -50 | tee -a $O/log.txt
xz -T4 $O/cuda-tests.log
while [ ! -e $out/models.rc ]; do sleep 2; done
g=$(awk '{print $2}' $out/models.txt)
one() { echo "$1 decode $($2 gpu --models $g --vocab none --reps 3 --only decode 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
few() { echo "$1 sessions $3 $($2 gpu --models $g --vocab none --reps 2 --only sessions --sessions $3 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
for round in 1 2; do
  one main $M; one pairs $W; few main $M 4; few pairs $W 4; few main $M 8; few pairs $W 8
done
if [ $(el) -lt 470 ]; then few main $M 64; few pairs $W 64; fi
echo "# end $(el) s" | tee -a $O/log.txt
