#!/bin/bash
# Call 4 (session 6, the warm H200 of run3): bulk copies' [quant] tests, then 64 sessions with bulk off/on (scaled off), the peer again.
set -u
repo=$PWD
. bench/gpu/unpack.sh ab
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))"; }
C=/tmp/bin/ab/combs-bench; P=$repo/build/peer/build-cuda/bin
g=/dev/shm/combs-models/llama-8b-q4_k_m-ggml-vocab-llama-bpe.gguf; ls -la $g | tee $O/log.txt
COMBS_IMMA_BULK=1 timeout 100 /tmp/bin/ab/combs_cuda_tests "[quant]" -d yes > $O/cuda-tests-bulk.log 2>&1; echo "# $(el) s: [quant] tests (bulk) rc $?" | tee -a $O/log.txt
tail -3 $O/cuda-tests-bulk.log | tee -a $O/log.txt
grep -B2 -A14 "FAILED" $O/cuda-tests-bulk.log | head -40 | tee -a $O/log.txt
run() { echo "scaled $1 bulk $2 $(COMBS_IMMA_SCALED=$1 COMBS_IMMA_BULK=$2 $C gpu --models $g --vocab none --reps 2 --only sessions --sessions 64 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
if grep -q "All tests passed" $O/cuda-tests-bulk.log; then run 0 0; run 0 1; run 0 0; run 0 1; else run 0 0; fi
$P/llama-batched-bench -m $g -ngl 99 -fa on -c $((64 * (1024 + 128))) -b 2048 -ub 512 -npp 1024 -ntg 128 -npl 64 --output-format jsonl 2>/dev/null | tee -a $O/log.txt
echo "# end $(el) s"
