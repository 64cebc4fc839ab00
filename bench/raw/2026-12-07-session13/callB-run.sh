#!/bin/bash
# Session 13, call B: why the tensor-core decode kernels lose at one row of x — the grid. Equal
# tiles a block leave some multiprocessors two blocks and others one (llama-8b's Q/K/V: 384 tiles,
# 2 a block, 192 blocks on 132 SMs). One session's decode with each kernel forced to one row
# (COMBS_Q4K_MMA_ROWS / COMBS_GEMV_MMA_ROWS=1) and COMBS_MMA_TILES_PER_BLOCK 1, 2, 4 against the
# default grid and the one-row kernels (default thresholds). Then speculation at 0% acceptance over
# 256 and 1,024 tokens.
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
model() {  # wait for shape:dtype $1, print its path
  while ! grep -q "^$1 " $O/models.rc 2>/dev/null; do sleep 2; done
  grep "${1%%:*}-${1##*:}" $O/models.txt | awk '{print $2}' | head -1
}
dec() { echo "$1 decode $(env $2 timeout 60 $B gpu --models $3 --vocab none --reps 3 --only decode 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
ses() { echo "$1 sessions $4 $(env $2 timeout 60 $B gpu --models $3 --vocab none --reps 2 --only sessions --sessions $4 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
q=$(model llama-8b:q4_k_m); echo "# q4_k_m $q ($(el) s)" | tee -a $O/log.txt
for round in 1 2; do
  dec old COMBS_NONE=1 $q
  dec tc-auto COMBS_Q4K_MMA_ROWS=1 $q
  dec tc-1 "COMBS_Q4K_MMA_ROWS=1 COMBS_MMA_TILES_PER_BLOCK=1" $q
  dec tc-4 "COMBS_Q4K_MMA_ROWS=1 COMBS_MMA_TILES_PER_BLOCK=4" $q
done
ses tc-auto COMBS_NONE=1 $q 8
ses tc-1 COMBS_MMA_TILES_PER_BLOCK=1 $q 8
b1=$(model llama-1b:bf16); echo "# 1b bf16 $b1 ($(el) s)" | tee -a $O/log.txt
for round in 1 2; do
  dec old COMBS_NONE=1 $b1
  dec tc-auto COMBS_GEMV_MMA_ROWS=1 $b1
  dec tc-1 "COMBS_GEMV_MMA_ROWS=1 COMBS_MMA_TILES_PER_BLOCK=1" $b1
  dec tc-4 "COMBS_GEMV_MMA_ROWS=1 COMBS_MMA_TILES_PER_BLOCK=4" $b1
done
# Speculation at 0% acceptance over longer generations (the warm-up's and probes' cost spread).
for tk in 256 1024; do
  echo "== spec llama-1b-bf16 --tokens $tk ($(el) s)" | tee -a $O/log.txt
  timeout 120 $B spec --device cuda --model $b1 --max-draft 4 --rounds 5 --tokens $tk --errors 1 2>&1 | grep "^|" | tee -a $O/log.txt
done
cat $O/models.rc >> $O/log.txt
echo "# end $(el) s" | tee -a $O/log.txt
