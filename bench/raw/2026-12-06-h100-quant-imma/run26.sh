#!/bin/bash
# ncu: quant_imma_kernel's SASS with executed instructions per line (8b gate/up Q4_K, n 64).
set -u
O=${OUT:-/tmp}
xz -dc .gpu/qgemv.xz > /tmp/qgemv && chmod +x /tmp/qgemv
NCU=/opt/nvidia/nsight-compute/2025.3.1/ncu
QGEMV_CASE=8b.gate_up.q4_k timeout 240 $NCU -k regex:quant_imma --launch-skip 2 --launch-count 1 --section SourceCounters --section WarpStateStats --import-source no -o $O/imma /tmp/qgemv 3 imma 64 > $O/ncu-run.txt 2>&1; echo "ncu rc $?"
$NCU -i $O/imma.ncu-rep --page source --csv --print-source sass > $O/imma-sass.csv 2>&1; echo "print rc $?"; wc -l $O/imma-sass.csv; head -3 $O/imma-sass.csv | cut -c1-400
