#!/bin/bash
# Call 3 (2026-12-06, session 4): 64 sessions of llama-8b Q4_K_M, quant_imma with the levels tile
# (COMBS_IMMA_DIRECT=0, HEAD's kernel), A fragments straight from the staged blocks for every format
# (1) and for Q4_K / Q5_K only (45), alternating (the peer ran in call 2, on the new kernel).
set -u
repo=$PWD
. bench/gpu/unpack.sh ab
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
out=/tmp/sbs; mkdir -p $out
export PEER_DIR=$repo/build/peer; P=$PEER_DIR/build-cuda/bin
models=/dev/shm/combs-models; mkdir -p $models
C=/tmp/bin/ab/combs-bench
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $O/log.txt
$C gpu --only models --shapes llama-8b --dtypes q4_k_m --dir $models --vocab $repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf > $out/models.txt 2> $out/models.log; echo "# $(el): models $?" | tee -a $O/log.txt
g=$(awk '{print $2}' $out/models.txt); ls -la $g
ab() {  # one run of variant $1
  echo "direct $1 $(COMBS_IMMA_DIRECT=$1 $C gpu --models $g --vocab none --reps 2 --only sessions --sessions 64 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el))" | tee -a $O/log.txt
}
ab 0; ab 1
for v in 0 1 45; do [ $(( $(date +%s) - t0 )) -lt 330 ] && ab $v; done
echo "# end $(el)"
