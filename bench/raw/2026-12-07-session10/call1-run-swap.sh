#!/bin/bash
# Session 9, one call (run-next.sh of session 8 plus COMBS_ATTN_SWAP, decode_swap_kernel): branch wip/attn-splits (main + temporary switches of the decode attention:
# COMBS_ATTN_SPLITS=N the grid's splits, COMBS_ATTN_STAGES=2|3 head_dim 128's one-warp blocks with
# fewer K/V stages and so more resident, COMBS_ATTN_FAST=1 tiles addressed from one page-table read
# with the splits' bounds on tile boundaries) built (portable, sm_90) and packed as .gpu/asp
# (combs-bench, combs_cuda_tests); the peer's source as .gpu/call2/llama-src.tar.xz. Every [cuda]
# test with FAST=1 STAGES=2 while llama-8b Q4_K_M is written and the peer built (niced); 64 sessions
# over the switches; the peer's batched bench on the same file; the best setting and the default
# alternated; ncu of one decode attention launch.
set -u
repo=$PWD
. bench/gpu/unpack.sh swp
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))"; }
out=/tmp/sbs; mkdir -p $out
export PEER_DIR=$repo/build/peer; P=$PEER_DIR/build-cuda/bin
B=/tmp/bin/swp; C=$B/combs-bench
models=/dev/shm/combs-models; mkdir -p $models
NCU=$(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); [ -n "$NCU" ] || NCU=$(command -v ncu)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $O/log.txt
[ -x $P/llama-batched-bench ] || setsid bash -c "nice bash '$repo/bench/peer/build.sh' cuda '$repo/.gpu/call2/llama-src.tar.xz' > '$out/peer-build.log' 2>&1; echo \$? > '$out/peer-build.rc'" </dev/null >/dev/null 2>&1 &
( $C gpu --only models --shapes llama-8b --dtypes q4_k_m --dir $models --vocab $repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf > $out/models.txt 2> $out/models.log; echo $? > $out/models.rc ) &
COMBS_ATTN_FAST=1 COMBS_ATTN_STAGES=3 $B/combs_cuda_tests "[cuda]" > /tmp/cuda-tests-fast.log 2>&1 &
tp=$!
COMBS_ATTN_SWAP=1 COMBS_ATTN_STAGES=2 $B/combs_cuda_tests "[cuda]" > /tmp/cuda-tests.log 2>&1; echo "# $(el) s: cuda tests (COMBS_ATTN_SWAP=1 COMBS_ATTN_STAGES=2) rc $?" | tee -a $O/log.txt
tail -2 /tmp/cuda-tests.log | tee -a $O/log.txt
grep -B2 -A14 "FAILED" /tmp/cuda-tests.log | head -60 | tee -a $O/log.txt
wait $tp; echo "# $(el) s: cuda tests (COMBS_ATTN_FAST=1 COMBS_ATTN_STAGES=3) rc $?" | tee -a $O/log.txt
tail -2 /tmp/cuda-tests-fast.log | tee -a $O/log.txt
grep -B2 -A14 "FAILED" /tmp/cuda-tests-fast.log | head -40 | tee -a $O/log.txt
while [ ! -e $out/models.rc ]; do sleep 2; done
echo "# $(el) s: models $(cat $out/models.rc)" | tee -a $O/log.txt
g=$(awk '{print $2}' $out/models.txt)
# run SPLITS STAGES FAST SWAP: one 64-session run ("" for the default)
run() { echo "stages ${2:-4} splits ${1:-auto} fast ${3:-0} swap ${4:-0} $(COMBS_ATTN_SPLITS=$1 COMBS_ATTN_STAGES=$2 COMBS_ATTN_FAST=$3 COMBS_ATTN_SWAP=$4 $C gpu --models $g --vocab none --reps 2 --only sessions --sessions 64 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
run "" "" "" ""; run "" 2 "" 1; run "" 3 "" 1; run "" "" "" 1; run "" 2 1 ""
peer() {
  $P/llama-batched-bench -m $g -ngl 99 -fa on -c $((64 * (1024 + 128))) -b 2048 -ub 512 -npp 1024 -ntg 128 -npl 64 --output-format jsonl > $out/peer-sessions.jsonl 2> $out/peer-sessions.log; echo "peer rc $? ($(el) s)" | tee -a $O/log.txt
  cat $out/peer-sessions.jsonl | tee -a $O/log.txt
}
while [ ! -e $out/peer-build.rc ] && [ ! -x $P/llama-batched-bench ] && [ $(el) -lt 400 ]; do sleep 2; done
echo "# $(el) s: peer build $(cat $out/peer-build.rc 2>/dev/null)" | tee -a $O/log.txt
# the best setting of the sweep (highest tok/s, the 9th field of the bench's line) against the default
best=$(grep '^stages' $O/log.txt | sort -t" " -k11 -g | tail -1 | awk '{print ($4 == "auto" ? "" : $4) "," ($2 == 4 ? "" : $2) "," ($6 == 0 ? "" : $6) "," ($8 == 0 ? "" : $8)}')
echo "# best: '$best'" | tee -a $O/log.txt
IFS=, read bs bt bf bw <<< "$best"
if [ -x $P/llama-batched-bench ]; then peer; run "$bs" "$bt" "$bf" "$bw"; run "" "" "" ""; peer; run "$bs" "$bt" "$bf" "$bw"; run "" "" "" ""; fi
[ $(el) -lt 380 ] && COMBS_ATTN_SPLITS=$bs COMBS_ATTN_STAGES=$bt COMBS_ATTN_FAST=$bf COMBS_ATTN_SWAP=$bw timeout 70 $NCU -k regex:"flash_kernel|decode_swap" --launch-skip 3000 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section SourceCounters -o $O/ncu-flash $C gpu --models $g --vocab none --reps 1 --only sessions --sessions 64 --attention-contexts '' > /tmp/ncu-flash-run.txt 2>&1; echo "# $(el) s: ncu flash rc $?" | tee -a $O/log.txt
tail -5 /tmp/ncu-flash-run.txt >> $O/log.txt; $NCU -i $O/ncu-flash.ncu-rep --page details > $O/ncu-flash-details.txt 2>&1
$NCU -i $O/ncu-flash.ncu-rep --page source --csv --print-source sass 2>&1 | xz -T4 > $O/ncu-flash-sass.csv.xz
echo "# end $(el) s" | tee -a $O/log.txt
