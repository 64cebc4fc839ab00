#!/bin/bash
# Session 10, call 6: the Q4_K decode GEMV a lane two units at a time (q4k_pair_dot; uncommitted
# tree on ee98140). Every [cuda] test (.gpu/g2) while llama-8b Q4_K_M is written; qgemv of main
# (.gpu/qg, ee98140) and of the change (.gpu/qg2) alternated; one session's decode (.gpu/g2b).
set -u
repo=$PWD
xz -dc .gpu/voc/ggml-vocab-llama-bpe.gguf.xz > tests/data/vocab/ggml-vocab-llama-bpe.gguf
. bench/gpu/unpack.sh g2 g2b qg qg2
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))"; }
out=/tmp/g2; mkdir -p $out
models=/dev/shm/combs-models; mkdir -p $models
C=/tmp/bin/g2b/combs-bench
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $O/log.txt
( $C gpu --only models --shapes llama-8b --dtypes q4_k_m --dir $models --vocab $repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf > $out/models.txt 2> $out/models.log; echo $? > $out/models.rc ) &
/tmp/bin/g2/combs_cuda_tests "[cuda]" > $O/cuda-tests.log 2>&1; echo "# $(el) s: cuda tests rc $?" | tee -a $O/log.txt
tail -2 $O/cuda-tests.log | tee -a $O/log.txt
grep -B3 -A10 "FAILED" $O/cuda-tests.log | head -50 | tee -a $O/log.txt
xz -T4 $O/cuda-tests.log
for i in 1 2; do
  QGEMV_ONLY=8b. /tmp/bin/qg/qgemv 20 > $O/qgemv-main-$i.txt 2>&1; echo "# $(el) s: qgemv main $i" | tee -a $O/log.txt
  QGEMV_ONLY=8b. /tmp/bin/qg2/qgemv 20 > $O/qgemv-pairs-$i.txt 2>&1; echo "# $(el) s: qgemv pairs $i" | tee -a $O/log.txt
done
grep auto $O/qgemv-main-1.txt $O/qgemv-pairs-1.txt | tee -a $O/log.txt
while [ ! -e $out/models.rc ] && [ $(el) -lt 200 ]; do sleep 2; done
g=$(awk '{print $2}' $out/models.txt 2>/dev/null)
[ -n "$g" ] && echo "one decode $($C gpu --models $g --vocab none --reps 3 --only decode 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt
echo "# end $(el) s" | tee -a $O/log.txt
