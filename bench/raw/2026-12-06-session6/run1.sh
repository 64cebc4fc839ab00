#!/bin/bash
# Call 1 (session 6): main's head (c86f940) on the H200 — every [cuda] test while llama-8b Q4_K_M is
# written and the peer built; 64 sessions x3 and one-session decode x1 from combs; the peer's
# batched bench (64 x 1,024 + 128) and llama-bench decode on the same file in the same call.
set -u
repo=$PWD
. bench/gpu/unpack.sh head
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
out=/tmp/sbs; mkdir -p $out
export PEER_DIR=$repo/build/peer; P=$PEER_DIR/build-cuda/bin
models=/dev/shm/combs-models; mkdir -p $models
C=/tmp/bin/head/combs-bench
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $O/log.txt
setsid bash -c "bash '$repo/bench/peer/build.sh' cuda '$repo/.gpu/call2/llama-src.tar.xz' > '$out/peer-build.log' 2>&1; echo \$? > '$out/peer-build.rc'" </dev/null >/dev/null 2>&1 &
( nice $C gpu --only models --shapes llama-8b --dtypes q4_k_m --dir $models --vocab $repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf > $out/models.txt 2> $out/models.log; echo $? > $out/models.rc ) &
/tmp/bin/head/combs_cuda_tests "[cuda]" -d yes > $O/cuda-tests.log 2>&1; echo "# $(el): cuda tests rc $?" | tee -a $O/log.txt
tail -3 $O/cuda-tests.log | tee -a $O/log.txt
grep -B2 -A14 "FAILED" $O/cuda-tests.log | head -60 | tee -a $O/log.txt
while [ ! -e $out/models.rc ]; do sleep 2; done
echo "# $(el): models $(cat $out/models.rc)" | tee -a $O/log.txt
g=$(awk '{print $2}' $out/models.txt); ls -la $g
run() { echo "combs $($C gpu --models $g --vocab none --reps 2 --only sessions --sessions 64 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el))" | tee -a $O/log.txt; }
run; run
echo "combs decode $($C gpu --models $g --vocab none --reps 3 --only decode --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el))" | tee -a $O/log.txt
while [ ! -e $out/peer-build.rc ] && [ $(( $(date +%s) - t0 )) -lt 420 ]; do sleep 2; done
echo "# $(el): peer $(cat $out/peer-build.rc 2>/dev/null)" | tee -a $O/log.txt
if [ -x $P/llama-batched-bench ]; then
  $P/llama-batched-bench -m $g -ngl 99 -fa on -c $((64 * (1024 + 128))) -b 2048 -ub 512 -npp 1024 -ntg 128 -npl 64 --output-format jsonl > $out/peer-sessions.jsonl 2> $out/peer-sessions.log; echo "peer rc $? ($(el))" | tee -a $O/log.txt
  cat $out/peer-sessions.jsonl | tee -a $O/log.txt
  run
  $P/llama-bench -m $g -ngl 99 -fa 1 -p 0 -n 256 -d 128 -r 3 -o json > $O/peer-decode.json 2> $out/peer-decode.log; echo "peer decode rc $? ($(el))" | tee -a $O/log.txt
  grep -E '"avg_ts"|"samples_ts"' $O/peer-decode.json | tee -a $O/log.txt
fi
echo "# end $(el)"
