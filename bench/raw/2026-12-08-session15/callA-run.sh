#!/bin/bash
# Session 15, call A: every [cuda] test at main's defaults (f32 attention at groups 3, 5, 6, 7 and the
# CPU vs CUDA presets case, both unrun on a GPU until now); the [quant] tests with Q4_K's unit loop
# reading words (COMBS_Q4K_UNIT_LOOP=words); then llama-8b Q4_K_M words vs bytes at 1 session (x2,
# alternated), 2, 3 and 8 sessions; the Q6_K tensor-core threshold at 2 and 3 rows (COMBS_Q6K_MMA_ROWS=2).
set -u
. bench/gpu/call.sh s15
B=/tmp/bin/s15/combs-bench; T=/tmp/bin/s15/combs_cuda_tests
( $B gpu --only models --shapes llama-8b --dtypes q4_k_m --dir $models --vocab $V >> $O/models.txt 2>> $O/models.log
  echo "llama-8b:q4_k_m $?" >> $O/models.rc ) &
tests() {  # name, env, filter
  timeout 200 env $2 $T "$3" > $O/tests-$1.log 2>&1; echo "# $(el) s: $1 $3: rc $?" | tee -a $O/log.txt
  tail -2 $O/tests-$1.log | tee -a $O/log.txt
  grep -B3 -A14 "FAILED" $O/tests-$1.log | head -80 | tee -a $O/log.txt
  grep "greedy equal for\|presets" $O/tests-$1.log | head -40 | tee -a $O/log.txt
  xz -T4 $O/tests-$1.log
}
tests defaults COMBS_NONE=1 "[cuda]"
tests words COMBS_Q4K_UNIT_LOOP=words "[quant]"
while ! grep -q "^llama-8b:q4_k_m " $O/models.rc 2>/dev/null; do sleep 2; done
q=$(grep "llama-8b-q4_k_m" $O/models.txt | awk '{print $2}' | head -1); echo "# model $q ($(el) s)" | tee -a $O/log.txt
ses() { echo "$1 sessions $4 $(env $2 timeout 40 $B gpu --models $3 --vocab none --reps 2 --only sessions --sessions $4 --attention-contexts '' 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
dec() { echo "$1 decode $(env $2 timeout 40 $B gpu --models $3 --vocab none --reps 3 --only decode 2>&1 | grep -v '^#' | tail -1) ($(el) s)" | tee -a $O/log.txt; }
for round in 1 2; do
  dec words COMBS_Q4K_UNIT_LOOP=words $q; dec bytes COMBS_NONE=1 $q
done
for n in 2 3; do
  ses words COMBS_Q4K_UNIT_LOOP=words $q $n; ses bytes COMBS_NONE=1 $q $n; ses q6k-from-2 COMBS_Q6K_MMA_ROWS=2 $q $n
done
ses words COMBS_Q4K_UNIT_LOOP=words $q 8; ses bytes COMBS_NONE=1 $q 8
cat $O/models.rc >> $O/log.txt
echo "# end $(el) s" | tee -a $O/log.txt
