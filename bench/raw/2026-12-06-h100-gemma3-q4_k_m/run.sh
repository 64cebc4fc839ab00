#!/bin/bash
# One call: gemma3-4b Q4_K_M (Gemma 4's vocabulary) combs vs the peer: 1-session decode, 16k-context decode, 64 sessions, prefill.
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
$C gpu --only models --shapes gemma3-4b --dtypes q4_k_m --dir $models --vocab /tmp/vocab/ggml-vocab-gemma-4.gguf > $out/models.txt 2>&1
g=$(awk '{print $2}' $out/models.txt); echo "model $g ($(el))"
while [ ! -e $out/peer-build.rc ]; do sleep 3; done; echo "peer rc $(cat $out/peer-build.rc) ($(el))"; tail -1 $out/peer-build.log
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
pj() { python3 -c "import json,sys; [print('  peer', d.get('n_prompt'), d.get('n_gen'), d.get('n_depth'), d.get('n_ubatch'), round(d['avg_ts'],1), [round(x,1) for x in d['samples_ts']]) for d in json.load(open('$1'))]"; }
for r in 1 2; do
echo "== round $r ($(el))"
$C gpu --models $g --vocab none --reps 3 --only decode 2>&1 | tail -1 | tee -a $O/log.txt
$P/llama-bench -m $g -ngl 99 -fa 1 -p 0 -n 256 -d 128 -r 3 -o json > $out/pd$r.json 2>/dev/null; pj $out/pd$r.json | tee -a $O/log.txt
$C gpu --models $g --vocab none --reps 2 --only decode --decode-prompt 16384 2>&1 | tail -1 | tee -a $O/log.txt
$P/llama-bench -m $g -ngl 99 -fa 1 -p 0 -n 256 -d 16384 -r 2 -o json > $out/p16$r.json 2>/dev/null; pj $out/p16$r.json | tee -a $O/log.txt
[ $r = 2 ] && break
$C gpu --models $g --vocab none --reps 2 --only sessions --sessions 64 2>&1 | tail -1 | tee -a $O/log.txt
timeout 120 $P/llama-batched-bench -m $g -ngl 99 -fa on -c $((64 * 1152)) -b 2048 -ub 512 -npp 1024 -ntg 128 -npl 64 --output-format jsonl 2>/dev/null | tail -1 | tee -a $O/log.txt
$C gpu --models $g --vocab none --reps 3 --only prefill 2>&1 | tail -1 | tee -a $O/log.txt
$P/llama-bench -m $g -ngl 99 -fa 1 -p 2048 -n 0 -b 2048 -ub 512,2048 -r 3 -o json > $out/pp$r.json 2>/dev/null; pj $out/pp$r.json | tee -a $O/log.txt
done
echo "# end $(el)"
