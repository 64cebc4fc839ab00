#!/bin/bash
# Session 13, call C: the Q6_K tensor-core decode kernel (q6k_mma_gemv_kernel, off by default:
# COMBS_Q6K_MMA_ROWS) — every [cuda] test with it from one row (and the three tensor-core decode
# kernels' shared loop, double_buffered, new), then llama-8b Q4_K_M (its
# output, some V and down are Q6_K) at 1, 4 and 8 sessions with and without it; the grid experiment
# of call B (COMBS_MMA_TILES_PER_BLOCK) on Q4_K at one row; speculation at 0% acceptance over 256
# and 1,024 tokens.
set -u
repo=$PWD
xz -dc .gpu/voc/ggml-vocab-llama-bpe.gguf.xz > tests/data/vocab/ggml-vocab-llama-bpe.gguf
. bench/gpu/unpack.sh s13
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))"; }
B=/tmp/bin/s13/combs-bench; V=$repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf
models=/dev/shm/combs-models; mkdir -p $models
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $O/log.txt
( for m in llama-8b:q4_k_m llama-1b:bf16; do
    $B gpu --only models --shapes ${m%%:*} --dtypes ${m##*:} --dir $models --vocab $V >> $O/models.txt 2>> $O/models.log
    echo "$m $?" >> $O/models.rc
  done ) &
COMBS_Q6K_MMA_ROWS=1 timeout 200 /tmp/bin/s13/combs_cuda_tests "[cuda]" > $O/quant-tests.log 2>&1; echo "# $(el) s: [cuda] tests with the Q6_K kernel from 1 row: rc $?" | tee -a $O/log.txt
tail -2 $O/quant-tests.log | tee -a $O/log.txt
grep -B3 -A14 "FAILED" $O/quant-tests.log | head -80 | tee -a $O/log.txt
xz -T4 $O/quant-tests.log
model() {  # wait for shape:dtype $1, print its path
  while ! grep -q "^$1 " $O/models.rc 2>/dev/null; do sleep 2; done
  grep "${1%%:*}-${1##*:}" $O/models.txt | awk '{print $2}' | head -1
}
dec() { echo "$1 decode $(env $2 timeout 60 $B gpu --models $3 --vocab none --reps 3 --only decode 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
ses() { echo "$1 sessions $4 $(env $2 timeout 60 $B gpu --models $3 --vocab none --reps 2 --only sessions --sessions $4 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
q=$(model llama-8b:q4_k_m); echo "# q4_k_m $q ($(el) s)" | tee -a $O/log.txt
ses main COMBS_NONE=1 $q 8; ses q6k COMBS_Q6K_MMA_ROWS=4 $q 8
ses main COMBS_NONE=1 $q 4; ses q6k COMBS_Q6K_MMA_ROWS=4 $q 4
dec main COMBS_NONE=1 $q; dec q6k-1 COMBS_Q6K_MMA_ROWS=1 $q
ses q6k-again COMBS_Q6K_MMA_ROWS=4 $q 8; ses main-again COMBS_NONE=1 $q 8
dec q4k-tc-auto COMBS_Q4K_MMA_ROWS=1 $q
dec q4k-tc-tiles1 "COMBS_Q4K_MMA_ROWS=1 COMBS_MMA_TILES_PER_BLOCK=1" $q
b1=$(model llama-1b:bf16); echo "# 1b bf16 $b1 ($(el) s)" | tee -a $O/log.txt
for tk in 1024; do
  echo "== spec llama-1b-bf16 --tokens $tk ($(el) s)" | tee -a $O/log.txt
  timeout 100 $B spec --device cuda --model $b1 --max-draft 4 --rounds 3 --tokens $tk --errors 1 2>&1 | grep "^|" | tee -a $O/log.txt
done
cat $O/models.rc >> $O/log.txt
echo "# end $(el) s" | tee -a $O/log.txt
