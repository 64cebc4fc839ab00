#!/bin/bash
# Session 15, call C: every [cuda] test at the new defaults (Q4_K's unit loop reading words; the Q6_K
# tensor-core kernel from 3 rows); llama-8b Q4_K_M at 1 and 3 sessions against the old defaults
# (COMBS_Q4K_UNIT_LOOP=bytes COMBS_Q6K_MMA_ROWS=4), alternated.
set -u
. bench/gpu/call.sh s15c
B=/tmp/bin/s15c/combs-bench; T=/tmp/bin/s15c/combs_cuda_tests
( $B gpu --only models --shapes llama-8b --dtypes q4_k_m --dir $models --vocab $V >> $O/models.txt 2>> $O/models.log
  echo "llama-8b:q4_k_m $?" >> $O/models.rc ) &
timeout 200 $T "[cuda]" > $O/tests.log 2>&1; echo "# $(el) s: [cuda] at the new defaults: rc $?" | tee -a $O/log.txt
tail -2 $O/tests.log | tee -a $O/log.txt
grep -B3 -A14 "FAILED" $O/tests.log | head -80 | tee -a $O/log.txt
grep "greedy equal for" $O/tests.log | head -40 | tee -a $O/log.txt
xz -T4 $O/tests.log
while ! grep -q "^llama-8b:q4_k_m " $O/models.rc 2>/dev/null; do sleep 2; done
q=$(grep "llama-8b-q4_k_m" $O/models.txt | awk '{print $2}' | head -1); echo "# model $q ($(el) s)" | tee -a $O/log.txt
ses() { echo "$1 sessions $4 $(env $2 timeout 40 $B gpu --models $3 --vocab none --reps 2 --only sessions --sessions $4 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
dec() { echo "$1 decode $(env $2 timeout 40 $B gpu --models $3 --vocab none --reps 3 --only decode 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
old="COMBS_Q4K_UNIT_LOOP=bytes COMBS_Q6K_MMA_ROWS=4"
for round in 1 2; do
  dec new COMBS_NONE=1 $q; dec old "$old" $q
done
ses new COMBS_NONE=1 $q 3; ses old "$old" $q 3
echo "# end $(el) s" | tee -a $O/log.txt
