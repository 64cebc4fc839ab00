#!/bin/bash
# Session 13, call A: every [cuda] test (the new one: weights resident on the device against the
# file's tensor bytes; the float64 split/bias/accumulate case at 5 and 8 rows, unrun until now),
# then the resident weights of real-size files (combs-bench gpu prints them before its figures) with
# one session's decode, and speculation at 0% acceptance.
set -u
repo=$PWD
xz -dc .gpu/voc/ggml-vocab-llama-bpe.gguf.xz > tests/data/vocab/ggml-vocab-llama-bpe.gguf
. bench/gpu/unpack.sh s13
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))"; }
B=/tmp/bin/s13/combs-bench; V=$repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf
models=/dev/shm/combs-models; mkdir -p $models
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $O/log.txt
( for m in llama-1b:bf16 llama-8b:q4_k_m llama-8b:bf16; do
    $B gpu --only models --shapes ${m%%:*} --dtypes ${m##*:} --dir $models --vocab $V >> $O/models.txt 2>> $O/models.log
    echo "$m $?" >> $O/models.rc
  done ) &
timeout 300 /tmp/bin/s13/combs_cuda_tests "[cuda]" > $O/cuda-tests.log 2>&1; echo "# $(el) s: cuda tests rc $?" | tee -a $O/log.txt
tail -2 $O/cuda-tests.log | tee -a $O/log.txt
grep -B3 -A14 "FAILED" $O/cuda-tests.log | head -120 | tee -a $O/log.txt
/tmp/bin/s13/combs_cuda_tests "the weights stay in their blocks on the gpu*" -s 2>&1 | grep -E "file's tensors|passed|failed" | head -3 | tee -a $O/log.txt
xz -T4 $O/cuda-tests.log
model() {  # wait for shape:dtype $1, print its path
  while ! grep -q "^$1 " $O/models.rc 2>/dev/null; do sleep 2; done
  grep "${1%%:*}-${1##*:}" $O/models.txt | awk '{print $2}' | head -1
}
dec() { echo "== $1 decode ($(el) s)" | tee -a $O/log.txt; timeout 90 $B gpu --models $2 --vocab none --reps 3 --only decode 2>&1 | tail -2 | tee -a $O/log.txt; }
spec() { echo "== spec $1 ($(el) s)" | tee -a $O/log.txt; timeout 150 $B spec --device cuda --model $2 --max-draft 4 --rounds 5 --errors 1,0.3,0 2>&1 | grep "^|" | tee -a $O/log.txt; }
b1=$(model llama-1b:bf16); dec llama-1b-bf16 $b1
spec llama-1b-bf16 $b1
q=$(model llama-8b:q4_k_m); dec llama-8b-q4_k_m $q
b8=$(model llama-8b:bf16); dec llama-8b-bf16 $b8
cat $O/models.rc >> $O/log.txt
echo "# end $(el) s" | tee -a $O/log.txt
