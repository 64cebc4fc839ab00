#!/bin/bash
# One call: quantize_act's block size (COMBS_QUANTIZE_THREADS 1024 / 512 / 256) on gemma3-4b Q4_K_M decode.
set -u
repo=$PWD
. bench/gpu/unpack.sh tp
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
out=/tmp/sbs; mkdir -p $out
models=/dev/shm/combs-models; mkdir -p $models
mkdir -p /tmp/vocab && tar xJf .gpu/vocab2.tar.xz -C /tmp/vocab ggml-vocab-gemma-4.gguf
C=/tmp/bin/tp/combs-bench
$C gpu --only models --shapes gemma3-4b --dtypes q4_k_m --dir $models --vocab /tmp/vocab/ggml-vocab-gemma-4.gguf > $out/models.txt 2> $out/models.log
echo "# $(el): models $?"
g=$(awk '{print $2}' $out/models.txt)
for r in 1 2; do
  for t in 1024 256 512; do echo "threads $t"; COMBS_QUANTIZE_THREADS=$t $C gpu --models $g --vocab none --reps 3 --only decode 2>&1 | tail -1 | tee -a $O/log.txt; done
done
for t in 1024 256; do echo "threads $t"; COMBS_QUANTIZE_THREADS=$t $C gpu --models $g --vocab none --reps 2 --only sessions --sessions 64 2>&1 | tail -1 | tee -a $O/log.txt; done
echo "# end $(el)"
