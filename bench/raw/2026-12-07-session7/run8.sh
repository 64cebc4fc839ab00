#!/bin/bash
# Ran as session 7's call 3 (asked for an H200, got an H100): outputs in call3-h100/.
# Session 7: main (abad16d, the unit sums always on) plus stream-K for quant_imma behind a
# temporary switch (COMBS_IMMA_STREAMK: 0 off, 1 every format, 2 Q4_K / Q5_K only), built
# (portable, sm_90) and packed as .gpu/sk (combs-bench, combs_cuda_tests); the peer's source as
# .gpu/call2/llama-src.tar.xz. One call: every [cuda] test with stream-K on for every format while
# llama-8b Q4_K_M is written and the peer built (niced); 64 sessions with the switch 0 / 1 / 2
# alternated; the peer's batched bench twice on the same file; kernel timelines of the step, 0 and 1.
set -u
repo=$PWD
. bench/gpu/unpack.sh sk
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))"; }
out=/tmp/sbs; mkdir -p $out
export PEER_DIR=$repo/build/peer; P=$PEER_DIR/build-cuda/bin
models=/dev/shm/combs-models; mkdir -p $models
B=/tmp/bin/sk; C=$B/combs-bench
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $O/log.txt
setsid bash -c "nice bash '$repo/bench/peer/build.sh' cuda '$repo/.gpu/call2/llama-src.tar.xz' > '$out/peer-build.log' 2>&1; echo \$? > '$out/peer-build.rc'" </dev/null >/dev/null 2>&1 &
( $C gpu --only models --shapes llama-8b --dtypes q4_k_m --dir $models --vocab $repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf > $out/models.txt 2> $out/models.log; echo $? > $out/models.rc ) &
COMBS_IMMA_STREAMK=1 $B/combs_cuda_tests "[cuda]" > $O/cuda-tests-streamk.log 2>&1; echo "# $(el) s: cuda tests (stream-K on, every format) rc $?" | tee -a $O/log.txt
tail -2 $O/cuda-tests-streamk.log | tee -a $O/log.txt
grep -B2 -A14 "FAILED" $O/cuda-tests-streamk.log | head -60 | tee -a $O/log.txt
while [ ! -e $out/models.rc ]; do sleep 2; done
echo "# $(el) s: models $(cat $out/models.rc)" | tee -a $O/log.txt
g=$(awk '{print $2}' $out/models.txt); ls -la $g
run() { echo "streamk $1 $(COMBS_IMMA_STREAMK=$1 $C gpu --models $g --vocab none --reps 2 --only sessions --sessions 64 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
run 0; run 1; run 2; run 0; run 1; run 2
peer() {
  $P/llama-batched-bench -m $g -ngl 99 -fa on -c $((64 * (1024 + 128))) -b 2048 -ub 512 -npp 1024 -ntg 128 -npl 64 --output-format jsonl > $out/peer-sessions.jsonl 2> $out/peer-sessions.log; echo "peer rc $? ($(el) s)" | tee -a $O/log.txt
  cat $out/peer-sessions.jsonl | tee -a $O/log.txt
}
while [ ! -e $out/peer-build.rc ] && [ $(el) -lt 420 ]; do sleep 2; done
echo "# $(el) s: peer build $(cat $out/peer-build.rc 2>/dev/null)" | tee -a $O/log.txt
if [ -x $P/llama-batched-bench ]; then peer; run 1; peer; run 0; fi
g++ -O2 -shared -fPIC -I/usr/local/cuda/include bench/gpu/timeline.cc -o /tmp/libtimeline.so -L/usr/local/cuda/lib64 -lcupti
for s in 0 1; do
  COMBS_IMMA_STREAMK=$s CUDA_INJECTION64_PATH=/tmp/libtimeline.so COMBS_TIMELINE=/tmp/t-sessions-$s.csv $C gpu --models $g --vocab none --reps 1 --only sessions --sessions 64 --attention-contexts '' 2>&1 | tail -1 | tee -a $O/log.txt
  python3 bench/gpu/timeline_batch.py /tmp/t-sessions-$s.csv > $O/kernels-64-sessions-streamk$s.txt 2>&1; echo "# $(el) s: timeline $s" | tee -a $O/log.txt
done
echo "# end $(el) s" | tee -a $O/log.txt
