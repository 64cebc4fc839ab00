#!/bin/bash
# Session 12, call I: the decode kernels chosen by rows (one row: gemv_kernel / the Q4_K unit loop;
# from COMBS_GEMV_MMA_ROWS=2 / COMBS_Q4K_MMA_ROWS=4 rows: the tensor-core kernels), with no cuBLAS
# detour for verification. Carry as callH-run.sh. Every [cuda] test while the models are written;
# then 2 and 3 sessions with each kernel forced (=1: tensor cores at every n; =9: never), to place
# the thresholds; speculation's replayed drafts at about 70% acceptance, the earlier path (=9 and
# COMBS_VERIFY_CUBLAS=1) against the new default, llama-1b and llama-8b BF16.
set -u
repo=$PWD
xz -dc .gpu/voc/ggml-vocab-llama-bpe.gguf.xz > tests/data/vocab/ggml-vocab-llama-bpe.gguf
. bench/gpu/unpack.sh mm
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))"; }
B=/tmp/bin/mm/combs-bench; V=$repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf
models=/dev/shm/combs-models; mkdir -p $models
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $O/log.txt
( for m in llama-8b:q4_k_m llama-1b:bf16 llama-8b:bf16; do
    $B gpu --only models --shapes ${m%%:*} --dtypes ${m##*:} --dir $models --vocab $V >> $O/models.txt 2>> $O/models.log
    echo "$m $?" >> $O/models.rc
  done ) &
timeout 240 /tmp/bin/mm/combs_cuda_tests "[cuda]" > $O/cuda-tests.log 2>&1; echo "# $(el) s: cuda tests rc $?" | tee -a $O/log.txt
tail -2 $O/cuda-tests.log | tee -a $O/log.txt
grep -B3 -A14 "FAILED" $O/cuda-tests.log | head -120 | tee -a $O/log.txt
xz -T4 $O/cuda-tests.log
model() {  # wait for shape:dtype $1, print its path
  while ! grep -q "^$1 " $O/models.rc 2>/dev/null; do sleep 2; done
  grep "${1%%:*}-${1##*:}" $O/models.txt | awk '{print $2}' | head -1
}
dec() { echo "$1 decode $(env $2 timeout 60 $B gpu --models $3 --vocab none --reps 3 --only decode 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
ses() { echo "$1 sessions $4 $(env $2 timeout 60 $B gpu --models $3 --vocab none --reps 2 --only sessions --sessions $4 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
spec() { echo "== spec $1 $3 ($(el) s)" | tee -a $O/log.txt; env $2 timeout 150 $B spec --device cuda --model $3 --max-draft 4 --rounds 3 --errors 1,0.2,0.15,0.1,0 2>&1 | grep "^|" | tee -a $O/log.txt; }
OLD="COMBS_GEMV_MMA_ROWS=9 COMBS_Q4K_MMA_ROWS=9 COMBS_VERIFY_CUBLAS=1"; NEW=COMBS_NONE=1
q=$(model llama-8b:q4_k_m); echo "# q4_k_m $q ($(el) s)" | tee -a $O/log.txt
dec default $NEW $q
for round in 1 2; do
  for s in 2 3; do ses units COMBS_Q4K_MMA_ROWS=9 $q $s; ses mma COMBS_Q4K_MMA_ROWS=1 $q $s; done
done
b1=$(model llama-1b:bf16); echo "# 1b bf16 $b1 ($(el) s)" | tee -a $O/log.txt
dec default $NEW $b1
for round in 1 2; do
  for s in 2 3; do ses fma COMBS_GEMV_MMA_ROWS=9 $b1 $s; ses mma COMBS_GEMV_MMA_ROWS=1 $b1 $s; done
done
spec old "$OLD" $b1; spec new $NEW $b1
b8=$(model llama-8b:bf16); echo "# 8b bf16 $b8 ($(el) s)" | tee -a $O/log.txt
for s in 2 3; do ses fma COMBS_GEMV_MMA_ROWS=9 $b8 $s; ses mma COMBS_GEMV_MMA_ROWS=1 $b8 $s; done
if [ $(el) -lt 420 ]; then spec old "$OLD" $b8; spec new $NEW $b8; fi
cat $O/models.rc >> $O/log.txt
echo "# end $(el) s" | tee -a $O/log.txt
