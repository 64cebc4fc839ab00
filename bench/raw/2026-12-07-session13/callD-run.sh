#!/bin/bash
# Session 13, call D (the device time's last minutes): every [cuda] test with the Q6_K tensor-core
# kernel from one row (COMBS_Q6K_MMA_ROWS=1) and the shared loop of the tensor-core decode kernels;
# then, while time is left, llama-8b Q4_K_M at 8 sessions with and without the Q6_K kernel.
set -u
repo=$PWD
xz -dc .gpu/voc/ggml-vocab-llama-bpe.gguf.xz > tests/data/vocab/ggml-vocab-llama-bpe.gguf
. bench/gpu/unpack.sh s13
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))"; }
B=/tmp/bin/s13/combs-bench; V=$repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf
models=/dev/shm/combs-models; mkdir -p $models
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $O/log.txt
( $B gpu --only models --shapes llama-8b --dtypes q4_k_m --dir $models --vocab $V > $O/models.txt 2>&1; echo "rc $?" >> $O/models.txt ) &
COMBS_Q6K_MMA_ROWS=1 timeout 150 /tmp/bin/s13/combs_cuda_tests "[cuda]" > $O/cuda-tests.log 2>&1; echo "# $(el) s: [cuda] tests, Q6_K kernel from 1 row: rc $?" | tee -a $O/log.txt
tail -2 $O/cuda-tests.log | tee -a $O/log.txt
grep -B3 -A14 "FAILED" $O/cuda-tests.log | head -80 | tee -a $O/log.txt
xz -T4 $O/cuda-tests.log
while ! grep -q "^rc" $O/models.txt; do sleep 2; done
q=$(grep "llama-8b-q4_k_m" $O/models.txt | awk '{print $2}' | head -1)
ses() { echo "$1 sessions $4 $(env $2 timeout 40 $B gpu --models $3 --vocab none --reps 2 --only sessions --sessions $4 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
ses main COMBS_NONE=1 $q 8; ses q6k COMBS_Q6K_MMA_ROWS=4 $q 8
ses main COMBS_NONE=1 $q 4; ses q6k COMBS_Q6K_MMA_ROWS=4 $q 4
echo "# end $(el) s" | tee -a $O/log.txt
