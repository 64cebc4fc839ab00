#!/bin/bash
# Session 12, call H (one device call): the tensor-core decode kernels (gemv_mma_kernel for BF16/F16,
# q4k_mma_gemv_kernel for Q4_K) against the kernels they replace, in the same binary (switches
# COMBS_GEMV_FMA=1, COMBS_Q4K_UNITS=1, COMBS_VERIFY_CUBLAS=1: the earlier verification detour).
# Carry [".gpu/libs", ".gpu/mm", ".gpu/voc"] with tests/data/vocab's four large files moved out
# (.gpu/voc: Llama 3's vocabulary, xz). Every [cuda] test while the models are written; then
# llama-8b Q4_K_M one session and 4 / 8 sessions; llama-1b and llama-8b BF16 one session, 5
# sessions, and speculation's replayed drafts (old path: FMA kernel + cuBLAS verification; new).
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
spec() { echo "== spec $1 $3 ($(el) s)" | tee -a $O/log.txt; env $2 timeout 120 $B spec --device cuda --model $3 --max-draft 4 --rounds 3 --errors 1,0.3,0.25,0 2>&1 | grep "^|" | tee -a $O/log.txt; }
OLDQ=COMBS_Q4K_UNITS=1; OLD16="COMBS_GEMV_FMA=1 COMBS_VERIFY_CUBLAS=1"; NEW=COMBS_NONE=1
q=$(model llama-8b:q4_k_m); echo "# q4_k_m $q ($(el) s)" | tee -a $O/log.txt
for round in 1 2; do
  dec units $OLDQ $q; dec mma $NEW $q; ses units $OLDQ $q 4; ses mma $NEW $q 4; ses units $OLDQ $q 8; ses mma $NEW $q 8
done
b1=$(model llama-1b:bf16); echo "# 1b bf16 $b1 ($(el) s)" | tee -a $O/log.txt
for round in 1 2; do
  dec fma "$OLD16" $b1; dec mma $NEW $b1; ses fma "$OLD16" $b1 5; ses mma $NEW $b1 5
done
spec "$OLD16" "$OLD16" $b1; spec new $NEW $b1
b8=$(model llama-8b:bf16); echo "# 8b bf16 $b8 ($(el) s)" | tee -a $O/log.txt
for round in 1 2; do
  dec fma "$OLD16" $b8; dec mma $NEW $b8; ses fma "$OLD16" $b8 5; ses mma $NEW $b8 5
done
if [ $(el) -lt 430 ]; then spec "$OLD16" "$OLD16" $b8; spec new $NEW $b8; fi
cat $O/models.rc >> $O/log.txt
echo "# end $(el) s" | tee -a $O/log.txt
