#!/bin/bash
# Call (session 6): c86f940 plus two quant_imma changes behind temporary switches: scaled levels
# (COMBS_IMMA_SCALED=1) and bulk copies (COMBS_IMMA_BULK=1); both off is c86f940's kernel. Every [cuda] test with the switch on while
# llama-8b Q4_K_M is written and the peer built; 64 sessions off/on alternated; the peer's batched
# bench on the same file; one-session decode of both if time allows.
set -u
repo=$PWD
. bench/gpu/unpack.sh ab
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))"; }
out=/tmp/sbs; mkdir -p $out
export PEER_DIR=$repo/build/peer; P=$PEER_DIR/build-cuda/bin
models=/dev/shm/combs-models; mkdir -p $models
C=/tmp/bin/ab/combs-bench
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $O/log.txt
setsid bash -c "bash '$repo/bench/peer/build.sh' cuda '$repo/.gpu/call2/llama-src.tar.xz' > '$out/peer-build.log' 2>&1; echo \$? > '$out/peer-build.rc'" </dev/null >/dev/null 2>&1 &
( nice $C gpu --only models --shapes llama-8b --dtypes q4_k_m --dir $models --vocab $repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf > $out/models.txt 2> $out/models.log; echo $? > $out/models.rc ) &
COMBS_IMMA_SCALED=1 /tmp/bin/ab/combs_cuda_tests "[cuda]" -d yes > $O/cuda-tests-scaled.log 2>&1; echo "# $(el) s: cuda tests (scaled) rc $?" | tee -a $O/log.txt
tail -3 $O/cuda-tests-scaled.log | tee -a $O/log.txt
grep -B2 -A14 "FAILED" $O/cuda-tests-scaled.log | head -60 | tee -a $O/log.txt
while [ ! -e $out/models.rc ]; do sleep 2; done
echo "# $(el) s: models $(cat $out/models.rc)" | tee -a $O/log.txt
g=$(awk '{print $2}' $out/models.txt); ls -la $g
run() { echo "scaled $1 bulk ${2:-0} $(COMBS_IMMA_SCALED=$1 COMBS_IMMA_BULK=${2:-0} $C gpu --models $g --vocab none --reps 2 --only sessions --sessions 64 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
run 0; run 1; run 0; run 1
while [ ! -e $out/peer-build.rc ] && [ $(el) -lt 430 ]; do sleep 2; done
echo "# $(el) s: peer $(cat $out/peer-build.rc 2>/dev/null)" | tee -a $O/log.txt
if [ -x $P/llama-batched-bench ]; then
  $P/llama-batched-bench -m $g -ngl 99 -fa on -c $((64 * (1024 + 128))) -b 2048 -ub 512 -npp 1024 -ntg 128 -npl 64 --output-format jsonl > $out/peer-sessions.jsonl 2> $out/peer-sessions.log; echo "peer rc $? ($(el) s)" | tee -a $O/log.txt
  cat $out/peer-sessions.jsonl | tee -a $O/log.txt
  run 1
fi
# bulk copies: the quantized tests (bounded: a wrong barrier would hang), then 64 sessions
COMBS_IMMA_BULK=1 COMBS_IMMA_SCALED=1 timeout 120 /tmp/bin/ab/combs_cuda_tests "[quant]" -d yes > $O/cuda-tests-bulk.log 2>&1; echo "# $(el) s: [quant] tests (bulk, scaled) rc $?" | tee -a $O/log.txt
tail -3 $O/cuda-tests-bulk.log | tee -a $O/log.txt
grep -B2 -A14 "FAILED" $O/cuda-tests-bulk.log | head -40 | tee -a $O/log.txt
if grep -q "All tests passed" $O/cuda-tests-bulk.log; then run 1 1; run 0 1; run 1 1; fi
if [ $(el) -lt 500 ]; then
  echo "combs decode $($C gpu --models $g --vocab none --reps 3 --only decode --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt
fi
if [ -x $P/llama-bench ] && [ $(el) -lt 530 ]; then
  timeout $((590 - $(el))) $P/llama-bench -m $g -ngl 99 -fa 1 -p 0 -n 256 -d 128 -r 3 -o json > $O/peer-decode.json 2> $out/peer-decode.log; echo "peer decode rc $? ($(el) s)" | tee -a $O/log.txt
  grep -E '"avg_ts"' $O/peer-decode.json | tee -a $O/log.txt
fi
echo "# end $(el) s"
