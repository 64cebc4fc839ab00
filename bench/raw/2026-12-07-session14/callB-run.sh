#!/bin/bash
# Session 14, call B: every [cuda] test at the new defaults (Q6_K tensor-core kernel from 4 rows;
# Q4_K's unit loop reading units as q4k_unit: scales as words, x's unit sums from the rounding; f32
# attention at groups 3, 5, 6, 7; the CPU vs CUDA presets case); then llama-8b Q4_K_M at 1, 2, 3
# sessions with the Q4_K unit loop's new reading and the old (COMBS_Q4K_UNIT_LOOP=bytes),
# alternated.
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
( for m in llama-8b:q4_k_m; do
    $B gpu --only models --shapes ${m%%:*} --dtypes ${m##*:} --dir $models --vocab $V >> $O/models.txt 2>> $O/models.log
    echo "$m $?" >> $O/models.rc
  done ) &
timeout 200 $T "[cuda]" > $O/cuda-tests.log 2>&1; echo "# $(el) s: [cuda] tests at the defaults: rc $?" | tee -a $O/log.txt
tail -2 $O/cuda-tests.log | tee -a $O/log.txt
grep -B3 -A14 "FAILED" $O/cuda-tests.log | head -100 | tee -a $O/log.txt
grep "greedy equal for" $O/cuda-tests.log | tee -a $O/log.txt
xz -T4 $O/cuda-tests.log
model() {  # wait for shape:dtype $1, print its path
  while ! grep -q "^$1 " $O/models.rc 2>/dev/null; do sleep 2; done
  grep "${1%%:*}-${1##*:}" $O/models.txt | awk '{print $2}' | head -1
}
ses() { echo "$1 sessions $4 $(env $2 timeout 40 $B gpu --models $3 --vocab none --reps 2 --only sessions --sessions $4 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
dec() { echo "$1 decode $(env $2 timeout 40 $B gpu --models $3 --vocab none --reps 3 --only decode 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
q=$(model llama-8b:q4_k_m); echo "# model $q ($(el) s)" | tee -a $O/log.txt
for round in 1 2; do
  dec words COMBS_NONE=1 $q; dec bytes COMBS_Q4K_UNIT_LOOP=bytes $q
done
ses words COMBS_NONE=1 $q 2; ses bytes COMBS_Q4K_UNIT_LOOP=bytes $q 2
ses words COMBS_NONE=1 $q 3; ses bytes COMBS_Q4K_UNIT_LOOP=bytes $q 3
cat $O/models.rc >> $O/log.txt
echo "# end $(el) s" | tee -a $O/log.txt
