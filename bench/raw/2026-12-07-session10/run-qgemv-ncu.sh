#!/bin/bash
# Session 10, call 5: where the one-session decode GEMVs lose bandwidth. bench/gpu/qgemv.cu (main at
# ee98140, built as its header says, packed as .gpu/qg): the table of every case, then ncu of the
# production variant ("auto", each case's fourth launch; ncu flushes the caches before it) of
# llama-8b's gate/up pair, Q4_K down and Q/K.
set -u
. bench/gpu/unpack.sh qg
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))"; }
Q=/tmp/bin/qg/qgemv
NCU=$(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); [ -n "$NCU" ] || NCU=$(command -v ncu)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $O/log.txt
$Q 20 > $O/qgemv.txt 2>&1; echo "# $(el) s: qgemv rc $?" | tee -a $O/log.txt
for c in 8b.gate_up 8b.down.q4_k 8b.qk; do
  [ $(el) -lt 200 ] || break
  QGEMV_ONLY=$c timeout 80 $NCU -k regex:quant_gemv_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats --section SourceCounters -o /tmp/ncu-$c $Q 1 > /tmp/ncu-$c.log 2>&1
  echo "# $(el) s: ncu $c rc $?" | tee -a $O/log.txt
  $NCU -i /tmp/ncu-$c.ncu-rep --page details > $O/ncu-$c.txt 2>&1
  [ $c = 8b.gate_up ] && $NCU -i /tmp/ncu-$c.ncu-rep --page source --csv --print-source sass 2>&1 | xz -T4 > $O/ncu-$c-sass.csv.xz
done
echo "# end $(el) s" | tee -a $O/log.txt
