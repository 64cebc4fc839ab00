#!/bin/bash
# One call: the decode GEMV's L2 prefetch of its later rows (COMBS_GEMV_PREFETCH=0 turns it off).
# [cuda] tests; then gemma3-4b Q4_K_M: combs prefetch on / off alternating with the peer (built in
# the background meanwhile), 64 sessions on / off; a kernel timeline at 128 (on).
set -u
repo=$PWD
. bench/gpu/unpack.sh tp
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
out=/tmp/sbs; mkdir -p $out
export PEER_DIR=$repo/build/peer; P=$PEER_DIR/build-cuda/bin
models=/dev/shm/combs-models; mkdir -p $models
mkdir -p /tmp/vocab && tar xJf .gpu/vocab2.tar.xz -C /tmp/vocab ggml-vocab-gemma-4.gguf
C=/tmp/bin/tp/combs-bench
setsid bash -c "bash '$repo/bench/peer/build.sh' cuda '$repo/.gpu/llama-src.tar.xz' > '$out/peer-build.log' 2>&1; echo \$? > '$out/peer-build.rc'" </dev/null >/dev/null 2>&1 &
setsid bash -c "$C gpu --only models --shapes gemma3-4b --dtypes q4_k_m --dir $models --vocab /tmp/vocab/ggml-vocab-gemma-4.gguf > $out/models.txt 2> $out/models.log; echo \$? > $out/models.rc" </dev/null >/dev/null 2>&1 &
/tmp/bin/tp/combs_cuda_tests "[cuda]" -d yes > $O/cuda-tests.log 2>&1; echo "tests rc $? ($(el))"
grep -E "FAILED" -A12 $O/cuda-tests.log | head -40; tail -2 $O/cuda-tests.log
while [ ! -e $out/models.rc ] && [ $(( $(date +%s) - t0 )) -lt 300 ]; do sleep 3; done
echo "# $(el): models $(cat $out/models.rc 2>/dev/null)"
g=$(awk '{print $2}' $out/models.txt)
pj() { python3 -c "import json,sys; [print('  peer', d.get('n_prompt'), d.get('n_gen'), d.get('n_depth'), round(d['avg_ts'],1), [round(x,1) for x in d['samples_ts']]) for d in json.load(open('$1'))]"; }
for r in 1 2; do
  for p in 1 0; do echo "prefetch $p"; COMBS_GEMV_PREFETCH=$p $C gpu --models $g --vocab none --reps 3 --only decode 2>&1 | tail -1 | tee -a $O/log.txt; done
done
while [ ! -e $out/peer-build.rc ] && [ $(( $(date +%s) - t0 )) -lt 420 ]; do sleep 3; done
echo "# $(el): peer $(cat $out/peer-build.rc 2>/dev/null)"
$P/llama-bench -m $g -ngl 99 -fa 1 -p 0 -n 256 -d 128 -r 3 -o json > $out/pd.json 2>/dev/null; pj $out/pd.json | tee -a $O/log.txt
echo "prefetch 1"; COMBS_GEMV_PREFETCH=1 $C gpu --models $g --vocab none --reps 3 --only decode 2>&1 | tail -1 | tee -a $O/log.txt
for p in 1 0; do echo "prefetch $p"; COMBS_GEMV_PREFETCH=$p $C gpu --models $g --vocab none --reps 2 --only sessions --sessions 64 2>&1 | tail -1 | tee -a $O/log.txt; done
echo "# $(el)"
g++ -O2 -shared -fPIC -I/usr/local/cuda/include bench/gpu/timeline.cc -o /tmp/libtimeline.so -L/usr/local/cuda/lib64 -lcupti
CUDA_INJECTION64_PATH=/tmp/libtimeline.so COMBS_TIMELINE=/tmp/t128.csv timeout 40 $C gpu --models $g --vocab none --reps 1 --only decode 2>&1 | tail -n 1
python3 bench/gpu/timeline.py /tmp/t128.csv 2>&1 | head -n 16 | tee $O/timeline-128.txt
echo "# end $(el)"
