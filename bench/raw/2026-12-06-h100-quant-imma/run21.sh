#!/bin/bash
# ncu on quant_imma_kernel (8b gate/up Q4_K, n 64 and 16): stall reasons, issue, memory.
set -u
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
xz -dc .gpu/qgemv.xz > /tmp/qgemv && chmod +x /tmp/qgemv
NCU=$(ls /usr/local/cuda/bin/ncu /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); echo "ncu: $NCU"
for n in 64 16; do
  QGEMV_CASE=8b.gate_up.q4_k timeout 200 $NCU -k regex:quant_imma --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis --section LaunchStats --section InstructionStats --print-details all /tmp/qgemv 3 imma $n > $O/ncu-$n.txt 2>&1; echo "ncu $n rc $? ($(el))"
  grep -E "Duration|Issued Ipc|Achieved Occupancy|Registers|Stall|Warp Cycles Per Issued|Eligible|Theoretical Occ|Block Limit|Memory Throughput|DRAM Throughput|L1/TEX Hit|Executed Instructions  |Grid Size|Waves" $O/ncu-$n.txt | head -50
done
