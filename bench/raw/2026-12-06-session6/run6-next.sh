#!/bin/bash
# For the next session (not run): branch wip/imma-unit-sums built (portable, CUDA sm_90) and packed
# as .gpu/sums (bench/gpu/pack.sh sums: combs-bench, combs_cuda_tests), the peer's source as
# .gpu/call2/llama-src.tar.xz. One call: every [cuda] test with the unit sums on while llama-8b
# Q4_K_M is written (at full priority: the peer's build is the one niced — call 3 of session 6 had
# it the other way and the write took 471 s) and the peer built; 64 sessions with the sums off / on
# alternated; the peer's batched bench on the same file; the winner again after it.
set -u
repo=$PWD
. bench/gpu/unpack.sh sums
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))"; }
out=/tmp/sbs; mkdir -p $out
export PEER_DIR=$repo/build/peer; P=$PEER_DIR/build-cuda/bin
models=/dev/shm/combs-models; mkdir -p $models
C=/tmp/bin/sums/combs-bench
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $O/log.txt
setsid bash -c "nice bash '$repo/bench/peer/build.sh' cuda '$repo/.gpu/call2/llama-src.tar.xz' > '$out/peer-build.log' 2>&1; echo \$? > '$out/peer-build.rc'" </dev/null >/dev/null 2>&1 &
( $C gpu --only models --shapes llama-8b --dtypes q4_k_m --dir $models --vocab $repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf > $out/models.txt 2> $out/models.log; echo $? > $out/models.rc ) &
COMBS_IMMA_SUMS=1 /tmp/bin/sums/combs_cuda_tests "[cuda]" -d yes > $O/cuda-tests-sums.log 2>&1; echo "# $(el) s: cuda tests (sums on) rc $?" | tee -a $O/log.txt
tail -3 $O/cuda-tests-sums.log | tee -a $O/log.txt
grep -B2 -A14 "FAILED" $O/cuda-tests-sums.log | head -60 | tee -a $O/log.txt
while [ ! -e $out/models.rc ]; do sleep 2; done
echo "# $(el) s: models $(cat $out/models.rc)" | tee -a $O/log.txt
g=$(awk '{print $2}' $out/models.txt); ls -la $g
run() { echo "sums $1 $(COMBS_IMMA_SUMS=$1 $C gpu --models $g --vocab none --reps 2 --only sessions --sessions 64 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
run 0; run 1; run 0; run 1
while [ ! -e $out/peer-build.rc ] && [ $(el) -lt 480 ]; do sleep 2; done
echo "# $(el) s: peer $(cat $out/peer-build.rc 2>/dev/null)" | tee -a $O/log.txt
if [ -x $P/llama-batched-bench ]; then
  $P/llama-batched-bench -m $g -ngl 99 -fa on -c $((64 * (1024 + 128))) -b 2048 -ub 512 -npp 1024 -ntg 128 -npl 64 --output-format jsonl > $out/peer-sessions.jsonl 2> $out/peer-sessions.log; echo "peer rc $? ($(el) s)" | tee -a $O/log.txt
  cat $out/peer-sessions.jsonl | tee -a $O/log.txt
  run 1
fi
echo "# end $(el) s"
