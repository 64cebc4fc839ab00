#!/bin/bash
# quant_imma against quant_mma (n 64, 16), then ncu on 8b gate/up n 64.
set -u
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
xz -dc .gpu/qgemv.xz > /tmp/qgemv && chmod +x /tmp/qgemv
for n in 64 16; do
  timeout 100 /tmp/qgemv 10 imma $n > $O/qgemv-imma-$n.log 2>&1; echo "qgemv $n rc $? ($(el))"
  awk -F'\t' '$2 ~ /imma/ {print $1, $2, $3, $5, $7, $8}' $O/qgemv-imma-$n.log | awk 'NR%3==2'
done
NCU=/opt/nvidia/nsight-compute/2025.3.1/ncu
QGEMV_CASE=8b.gate_up.q4_k timeout 200 $NCU -k regex:quant_imma --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section InstructionStats --section Occupancy /tmp/qgemv 3 imma 64 > $O/ncu-64.txt 2>&1; echo "ncu rc $? ($(el))"
grep -E "Duration|Warp Cycles Per Issued|Stall (Wait|Short|Long|Not Sel|Math)|Executed Instructions  |Registers Per" $O/ncu-64.txt | head -12
