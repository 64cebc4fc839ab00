#!/bin/bash
# Session 14, call A: every [cuda] test with the Q6_K tensor-core kernel from one row
# (COMBS_Q6K_MMA_ROWS=1: validates q6k_mma_gemv_kernel and 042699e's shared loop, never run on a
# GPU) and the block-quantized CPU vs CUDA case over llama.cpp's 20 presets; the [quant] cases again
# at the defaults; then llama-8b Q4_K_M at 1, 4 and 8 sessions with and without the Q6_K kernel,
# and the grid experiment (COMBS_MMA_TILES_PER_BLOCK) on the Q4_K tensor-core kernel at one row.
set -u
repo=$PWD
xz -dc .gpu/voc/ggml-vocab-llama-bpe.gguf.xz > tests/data/vocab/ggml-vocab-llama-bpe.gguf
mkdir -p tests/data/models && tar -xJf .gpu/voc/presets.tar.xz -C tests/data/models
. bench/gpu/unpack.sh s14
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))"; }
B=/tmp/bin/s14/combs-bench; T=/tmp/bin/s14/combs_cuda_tests; V=$repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf
models=/dev/shm/combs-models; mkdir -p $models
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $O/log.txt
( $B gpu --only models --shapes llama-8b --dtypes q4_k_m --dir $models --vocab $V > $O/models.txt 2>&1; echo "rc $?" >> $O/models.txt ) &
COMBS_Q6K_MMA_ROWS=1 timeout 200 $T "[cuda]" > $O/cuda-tests.log 2>&1; echo "# $(el) s: [cuda] tests, Q6_K kernel from 1 row: rc $?" | tee -a $O/log.txt
tail -2 $O/cuda-tests.log | tee -a $O/log.txt
grep -B3 -A14 "FAILED" $O/cuda-tests.log | head -80 | tee -a $O/log.txt
grep "greedy equal for" $O/cuda-tests.log | tee -a $O/log.txt
xz -T4 $O/cuda-tests.log
timeout 100 $T "[quant]" > $O/quant-default.log 2>&1; echo "# $(el) s: [quant] tests at the defaults: rc $?" | tee -a $O/log.txt
tail -2 $O/quant-default.log | tee -a $O/log.txt
grep -B3 -A14 "FAILED" $O/quant-default.log | head -40 | tee -a $O/log.txt
rm -f $O/quant-default.log
while ! grep -q "^rc" $O/models.txt; do sleep 2; done
q=$(grep "llama-8b-q4_k_m" $O/models.txt | awk '{print $2}' | head -1)
echo "# model $q ($(el) s)" | tee -a $O/log.txt
ses() { echo "$1 sessions $4 $(env $2 timeout 40 $B gpu --models $3 --vocab none --reps 2 --only sessions --sessions $4 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
dec() { echo "$1 decode $(env $2 timeout 40 $B gpu --models $3 --vocab none --reps 3 --only decode 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
ses main COMBS_NONE=1 $q 8; ses q6k COMBS_Q6K_MMA_ROWS=4 $q 8
ses main COMBS_NONE=1 $q 4; ses q6k COMBS_Q6K_MMA_ROWS=4 $q 4
dec main COMBS_NONE=1 $q; dec q6k-1 COMBS_Q6K_MMA_ROWS=1 $q
ses q6k-again COMBS_Q6K_MMA_ROWS=4 $q 8; ses main-again COMBS_NONE=1 $q 8
dec q4k-tc COMBS_Q4K_MMA_ROWS=1 $q
dec q4k-tc-tiles1 "COMBS_Q4K_MMA_ROWS=1 COMBS_MMA_TILES_PER_BLOCK=1" $q
dec main-again COMBS_NONE=1 $q
echo "# end $(el) s" | tee -a $O/log.txt
