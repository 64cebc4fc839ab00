#!/bin/bash
# llama-8b Q4_K_M, 64 sessions (1,024-token prompts, 128 new): combs with the 8-bit batch kernel
# (COMBS_BATCH_Q8=1) and without (0, the BF16 kernel) alternating; the peer's llama-batched-bench.
set -u
repo=$PWD
. bench/gpu/unpack.sh tp
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
out=/tmp/sbs; mkdir -p $out
export PEER_DIR=$repo/build/peer; P=$PEER_DIR/build-cuda/bin
models=/dev/shm/combs-models; mkdir -p $models
C=/tmp/bin/tp/combs-bench
setsid bash -c "bash '$repo/bench/peer/build.sh' cuda '$repo/.gpu/llama-src.tar.xz' > '$out/peer-build.log' 2>&1; echo \$? > '$out/peer-build.rc'" </dev/null >/dev/null 2>&1 &
$C gpu --only models --shapes llama-8b --dtypes q4_k_m --dir $models --vocab $repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf > $out/models.txt 2> $out/models.log; echo "# $(el): models $?"
g=$(awk '{print $2}' $out/models.txt); ls -la $g
for r in 1 2; do
  for p in 1 0; do echo "batch_q8 $p $(COMBS_BATCH_Q8=$p $C gpu --models $g --vocab none --reps 2 --only sessions --sessions 64 --attention-contexts '' 2>&1 | grep -v '^#' | tail -2 | tr '\n' ' ') ($(el))" | tee -a $O/log.txt; done
done
while [ ! -e $out/peer-build.rc ] && [ $(( $(date +%s) - t0 )) -lt 480 ]; do sleep 3; done
echo "# $(el): peer $(cat $out/peer-build.rc 2>/dev/null)"
$P/llama-batched-bench -m $g -ngl 99 -fa on -c $((64 * (1024 + 128))) -b 2048 -ub 512 -npp 1024 -ntg 128 -npl 64 --output-format jsonl > $out/peer-sessions.jsonl 2> $out/peer-sessions.log; echo "peer rc $? ($(el))"
cat $out/peer-sessions.jsonl | tee -a $O/log.txt
echo "batch_q8 1 $(COMBS_BATCH_Q8=1 $C gpu --models $g --vocab none --reps 2 --only sessions --sessions 64 --attention-contexts '' 2>&1 | grep -v '^#' | tail -2 | tr '\n' ' ') ($(el))" | tee -a $O/log.txt
echo "# end $(el)"
