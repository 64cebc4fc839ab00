#!/bin/bash
# Call 1 of 2026-12-06 (late): the two-warp head_dim-256 decode and the grouped split merge.
# Attention tests + microbench + all [cuda] tests; gemma3-4b Q4_K_M decode (128 and 16k) with a
# 16k timeline; peer build and the Q4_K_M gemma3-4b / qwen3-8b files in the background for call 2.
set -u
repo=$PWD
. bench/gpu/unpack.sh tp
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
out=/tmp/sbs; mkdir -p $out
export PEER_DIR=$repo/build/peer
models=/dev/shm/combs-models; mkdir -p $models
mkdir -p /tmp/vocab && tar xJf .gpu/vocab2.tar.xz -C /tmp/vocab
C=/tmp/bin/tp/combs-bench
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee $O/gpu.txt
setsid bash -c "bash '$repo/bench/peer/build.sh' cuda '$repo/.gpu/llama-src.tar.xz' > '$out/peer-build.log' 2>&1; echo \$? > '$out/peer-build.rc'" </dev/null >/dev/null 2>&1 &
setsid bash -c "$C gpu --only models --shapes gemma3-4b --dtypes q4_k_m --dir $models --vocab /tmp/vocab/ggml-vocab-gemma-4.gguf > $out/models.txt 2> $out/models.log && $C gpu --only models --shapes qwen3-8b --dtypes q4_k_m --dir $models --vocab /tmp/vocab/ggml-vocab-qwen2.gguf >> $out/models.txt 2>> $out/models.log; echo \$? > $out/models.rc" </dev/null >/dev/null 2>&1 &
/tmp/bin/tp/combs_cuda_tests "cuda paged attention*" > $O/attn-tests.log 2>&1; echo "attention tests rc $? ($(el))"; tail -2 $O/attn-tests.log
$C gpu --only attention --attention-shapes 32/8/128,8/4/256 --attention-contexts 2048,16384 --vocab none 2>&1 | tee $O/attention.txt
echo "# $(el)"
/tmp/bin/tp/combs_cuda_tests "[cuda]" -d yes > $O/cuda-tests.log 2>&1; echo "tests rc $? ($(el))"
grep -E "FAILED" -A12 $O/cuda-tests.log | head -40; tail -3 $O/cuda-tests.log
while [ ! -s $out/models.txt ] && [ $(( $(date +%s) - t0 )) -lt 480 ]; do sleep 3; done
g=$(awk '$1=="gemma3-4b-q4_k_m"{print $2}' $out/models.txt); echo "gemma3 $g ($(el))"
if [ -s "$g" ]; then
  $C gpu --models $g --vocab none --reps 3 --only decode 2>&1 | tail -1 | tee -a $O/log.txt
  $C gpu --models $g --vocab none --reps 2 --only decode --decode-prompt 16384 2>&1 | tail -1 | tee -a $O/log.txt
  if [ $(( $(date +%s) - t0 )) -lt 540 ]; then
    g++ -O2 -shared -fPIC -I/usr/local/cuda/include bench/gpu/timeline.cc -o /tmp/libtimeline.so -L/usr/local/cuda/lib64 -lcupti
    CUDA_INJECTION64_PATH=/tmp/libtimeline.so COMBS_TIMELINE=/tmp/t16.csv timeout 40 $C gpu --models $g --vocab none --reps 1 --only decode --decode-prompt 16384 2>&1 | tail -n 1
    python3 bench/gpu/timeline.py /tmp/t16.csv 2>&1 | head -n 45 | tee $O/timeline-16k.txt
  fi
fi
echo "# end $(el): peer $(cat $out/peer-build.rc 2>/dev/null || echo running), models $(cat $out/models.rc 2>/dev/null || echo running)"
