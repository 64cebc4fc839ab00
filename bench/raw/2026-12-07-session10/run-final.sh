#!/bin/bash
# Session 10, call 4: the landed build of the 8-bit rounding fused for batches (takes_q8 up to 64 rows of the
# super-block formats: the norm's kernel rounds x; matmul_swiglu rounds silu(gate) * up in the
# rounding kernel) built as .gpu/fz (fz2, no switch).
# Every [cuda] test while llama-8b Q4_K_M is written and the peer built (niced); then 64 sessions
# and the peer's batched bench, alternated.
set -u
repo=$PWD
xz -dc .gpu/voc/ggml-vocab-llama-bpe.gguf.xz > tests/data/vocab/ggml-vocab-llama-bpe.gguf
. bench/gpu/unpack.sh fz2
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))"; }
out=/tmp/fz2; mkdir -p $out
export PEER_DIR=$repo/build/peer; P=$PEER_DIR/build-cuda/bin
C=/tmp/bin/fz2/combs-bench
models=/dev/shm/combs-models; mkdir -p $models
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $O/log.txt
[ -x $P/llama-batched-bench ] || setsid bash -c "nice bash '$repo/bench/peer/build.sh' cuda '$repo/.gpu/call2/llama-src.tar.xz' > '$out/peer-build.log' 2>&1; echo \$? > '$out/peer-build.rc'" </dev/null >/dev/null 2>&1 &
( $C gpu --only models --shapes llama-8b --dtypes q4_k_m --dir $models --vocab $repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf > $out/models.txt 2> $out/models.log; echo $? > $out/models.rc ) &
/tmp/bin/fz2/combs_cuda_tests "[cuda]" > $O/cuda-tests.log 2>&1; echo "# $(el) s: cuda tests rc $?" | tee -a $O/log.txt
tail -2 $O/cuda-tests.log | tee -a $O/log.txt
grep -B3 -A8 "FAILED" $O/cuda-tests.log | head -60 | tee -a $O/log.txt
xz -T4 $O/cuda-tests.log
while [ ! -e $out/models.rc ]; do sleep 2; done
echo "# $(el) s: models $(cat $out/models.rc)" | tee -a $O/log.txt
g=$(awk '{print $2}' $out/models.txt)
many() { echo "fuse ${1:-1} sessions $(COMBS_Q8_FUSE=$1 $C gpu --models $g --vocab none --reps 2 --only sessions --sessions 64 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
echo "one decode $($C gpu --models $g --vocab none --reps 3 --only decode 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt
many 1
peer() {
  $P/llama-batched-bench -m $g -ngl 99 -fa on -c $((64 * (1024 + 128))) -b 2048 -ub 512 -npp 1024 -ntg 128 -npl 64 --output-format jsonl > $out/peer-sessions.jsonl 2> $out/peer-sessions.log; echo "peer rc $? ($(el) s)" | tee -a $O/log.txt
  cat $out/peer-sessions.jsonl | tee -a $O/log.txt
}
while [ ! -e $out/peer-build.rc ] && [ ! -x $P/llama-batched-bench ] && [ $(el) -lt 420 ]; do sleep 2; done
echo "# $(el) s: peer build $(cat $out/peer-build.rc 2>/dev/null)" | tee -a $O/log.txt
if [ -x $P/llama-batched-bench ]; then peer; many 1; peer; many 1; peer; many 1; fi
echo "# end $(el) s" | tee -a $O/log.txt
