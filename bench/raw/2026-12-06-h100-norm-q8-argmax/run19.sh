#!/bin/bash
# A lean call: [cuda] tests (the model written meanwhile); gemma3-4b Q4_K_M decode, norms rounding
# x to 8 bits on, off, on (COMBS_NORM_Q8). No peer.
set -u
. bench/gpu/unpack.sh tp
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
out=/tmp/sbs; mkdir -p $out
models=/dev/shm/combs-models; mkdir -p $models
mkdir -p /tmp/vocab && tar xJf .gpu/vocab2.tar.xz -C /tmp/vocab ggml-vocab-gemma-4.gguf
C=/tmp/bin/tp/combs-bench
setsid bash -c "$C gpu --only models --shapes gemma3-4b --dtypes q4_k_m --dir $models --vocab /tmp/vocab/ggml-vocab-gemma-4.gguf > $out/models.txt 2> $out/models.log; echo \$? > $out/models.rc" </dev/null >/dev/null 2>&1 &
/tmp/bin/tp/combs_cuda_tests "[cuda]" -d yes > $O/cuda-tests.log 2>&1; echo "tests rc $? ($(el))" | tee -a $O/log.txt
grep -E "FAILED" -A12 $O/cuda-tests.log | head -40; tail -2 $O/cuda-tests.log
while [ ! -e $out/models.rc ] && [ $(( $(date +%s) - t0 )) -lt 220 ]; do sleep 2; done
echo "# $(el): models $(cat $out/models.rc 2>/dev/null)"
g=$(awk '{print $2}' $out/models.txt)
for p in 1 0 1; do echo "norm_q8 $p" | tee -a $O/log.txt; COMBS_NORM_Q8=$p $C gpu --models $g --vocab none --reps 3 --only decode 2>&1 | tail -1 | tee -a $O/log.txt; done
echo "# end $(el)"
