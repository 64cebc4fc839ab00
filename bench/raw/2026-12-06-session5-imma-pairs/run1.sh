#!/bin/bash
# Call: every [cuda] test with 8-warp quant_imma (COMBS_IMMA_PAIRS=1) and the last split's merge;
# llama-8b Q4_K_M written and the peer built meanwhile; 64 sessions: fold / pairs on and off, a
# timeline of the new configuration, the peer on the same file.
# (Built from 6f0e71f plus the change with two temporary switches, COMBS_ATTN_FOLD and
# COMBS_IMMA_PAIRS; aba3ffc keeps the winners and removes the switches.)
set -u
repo=$PWD
. bench/gpu/unpack.sh fold
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
out=/tmp/sbs; mkdir -p $out
export PEER_DIR=$repo/build/peer; P=$PEER_DIR/build-cuda/bin
models=/dev/shm/combs-models; mkdir -p $models
C=/tmp/bin/fold/combs-bench
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $O/log.txt
setsid bash -c "nice bash '$repo/bench/peer/build.sh' cuda '$repo/.gpu/call/llama-src.tar.xz' > '$out/peer-build.log' 2>&1; echo \$? > '$out/peer-build.rc'" </dev/null >/dev/null 2>&1 &
( $C gpu --only models --shapes llama-8b --dtypes q4_k_m --dir $models --vocab $repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf > $out/models.txt 2> $out/models.log; echo $? > $out/models.rc ) &
COMBS_IMMA_PAIRS=1 /tmp/bin/fold/combs_cuda_tests "[cuda]" -d yes > $O/cuda-tests.log 2>&1; echo "# $(el): cuda tests (pairs, fold) rc $?" | tee -a $O/log.txt
tail -3 $O/cuda-tests.log | tee -a $O/log.txt
grep -B2 -A14 "FAILED" $O/cuda-tests.log | head -60 | tee -a $O/log.txt
while [ ! -e $out/models.rc ]; do sleep 2; done
echo "# $(el): models $(cat $out/models.rc)" | tee -a $O/log.txt
g=$(awk '{print $2}' $out/models.txt); ls -la $g
run() { echo "fold $1 pairs $2 $(COMBS_ATTN_FOLD=$1 COMBS_IMMA_PAIRS=$2 $C gpu --models $g --vocab none --reps 2 --only sessions --sessions 64 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el))" | tee -a $O/log.txt; }
for r in 1 2; do run 0 0; run 1 0; run 1 1; done
g++ -O2 -shared -fPIC -I/usr/local/cuda/include bench/gpu/timeline.cc -o /tmp/libtimeline.so -L/usr/local/cuda/lib64 -lcupti
COMBS_IMMA_PAIRS=1 CUDA_INJECTION64_PATH=/tmp/libtimeline.so COMBS_TIMELINE=/tmp/t-sessions.csv $C gpu --models $g --vocab none --reps 1 --only sessions --sessions 64 --attention-contexts '' 2>&1 | tail -1
xz -T4 -c /tmp/t-sessions.csv > $O/timeline-sessions-64-pairs-fold.csv.xz; echo "# $(el): timeline" | tee -a $O/log.txt
while [ ! -e $out/peer-build.rc ] && [ $(( $(date +%s) - t0 )) -lt 540 ]; do sleep 3; done
echo "# $(el): peer $(cat $out/peer-build.rc 2>/dev/null)" | tee -a $O/log.txt
tail -2 $out/peer-build.log
$P/llama-batched-bench -m $g -ngl 99 -fa on -c $((64 * (1024 + 128))) -b 2048 -ub 512 -npp 1024 -ntg 128 -npl 64 --output-format jsonl > $out/peer-sessions.jsonl 2> $out/peer-sessions.log; echo "peer rc $? ($(el))"
cat $out/peer-sessions.jsonl | tee -a $O/log.txt
run 1 1
echo "# end $(el)"
