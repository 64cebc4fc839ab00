#!/bin/bash
# Session 10, one call: branch attn-swap (decode_swap_kernel the decode kernel for head_dim 64/128,
# G <= 8, two stages; split bounds on tile boundaries for every cache) built (portable, sm_90) and
# packed as .gpu/as2; wip/attn-splits' combs-bench as .gpu/swpb (its default = main's flash_kernel
# decode). Every [cuda] test of as2 while llama-8b Q4_K_M is written; decode attention alone, one
# session's decode and 64 sessions, as2 against main's kernel, alternated.
set -u
repo=$PWD
xz -dc .gpu/voc/ggml-vocab-llama-bpe.gguf.xz > tests/data/vocab/ggml-vocab-llama-bpe.gguf
. bench/gpu/unpack.sh as2 swpb
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))"; }
out=/tmp/as2; mkdir -p $out
A=/tmp/bin/as2/combs-bench; W=/tmp/bin/swpb/combs-bench
models=/dev/shm/combs-models; mkdir -p $models
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $O/log.txt
( $A gpu --only models --shapes llama-8b --dtypes q4_k_m --dir $models --vocab $repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf > $out/models.txt 2> $out/models.log; echo $? > $out/models.rc ) &
/tmp/bin/as2/combs_cuda_tests "[cuda]" > $O/cuda-tests.log 2>&1; echo "# $(el) s: cuda tests rc $?" | tee -a $O/log.txt
tail -2 $O/cuda-tests.log | tee -a $O/log.txt
grep -A3 "FAILED" $O/cuda-tests.log | grep -v "^--" | head -40 | tee -a $O/log.txt
xz -T4 $O/cuda-tests.log
att() { echo "## $1 attention ($(el) s)" | tee -a $O/log.txt; $2 gpu --only attention --attention-shapes 32/8/128,32/8/64 --vocab none 2>&1 | grep '^|' | tee -a $O/log.txt; }
att swap $A; att flash $W
while [ ! -e $out/models.rc ]; do sleep 2; done
echo "# $(el) s: models $(cat $out/models.rc)" | tee -a $O/log.txt
g=$(awk '{print $2}' $out/models.txt)
one() { echo "$1 decode $($2 gpu --models $g --vocab none --reps 3 --only decode 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
many() { echo "$1 sessions $($2 gpu --models $g --vocab none --reps 2 --only sessions --sessions 64 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
one swap $A; one flash $W; many swap $A; many flash $W
one swap $A; one flash $W; many swap $A; many flash $W
att swap $A; att flash $W
echo "# end $(el) s" | tee -a $O/log.txt
