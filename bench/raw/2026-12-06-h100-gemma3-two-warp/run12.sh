#!/bin/bash
# Call 2 (same warm machine as run11.sh): gemma3-4b Q4_K_M against the peer (decode after 128 and
# 16,384 tokens, 64 sessions) and qwen3-8b Q4_K_M's first side by side (issue 24).
set -u
repo=$PWD; here=$repo/bench/gpu
. bench/gpu/unpack.sh tp
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
out=/tmp/sbs; mkdir -p $out
export PEER_DIR=$repo/build/peer; P=$PEER_DIR/build-cuda/bin; peer_bin=$P
C=/tmp/bin/tp/combs-bench; combs=$C
. $here/side_by_side_round.sh
while { [ ! -e $out/peer-build.rc ] || [ ! -e $out/models.rc ]; } && [ $(( $(date +%s) - t0 )) -lt 200 ]; do sleep 3; done
echo "# $(el): peer $(cat $out/peer-build.rc), models $(cat $out/models.rc)"; tail -1 $out/peer-build.log
g=$(awk '$1=="gemma3-4b-q4_k_m"{print $2}' $out/models.txt); q=$(awk '$1=="qwen3-8b-q4_k_m"{print $2}' $out/models.txt)
pj() { python3 -c "import json,sys; [print('  peer', d.get('n_prompt'), d.get('n_gen'), d.get('n_depth'), d.get('n_ubatch'), round(d['avg_ts'],1), [round(x,1) for x in d['samples_ts']]) for d in json.load(open('$1'))]"; }
echo "== gemma3 ($(el))"
$C gpu --models $g --vocab none --reps 3 --only decode 2>&1 | tail -1 | tee -a $O/log.txt
$P/llama-bench -m $g -ngl 99 -fa 1 -p 0 -n 256 -d 128 -r 3 -o json > $out/pd.json 2>/dev/null; pj $out/pd.json | tee -a $O/log.txt
$C gpu --models $g --vocab none --reps 2 --only decode --decode-prompt 16384 2>&1 | tail -1 | tee -a $O/log.txt
$P/llama-bench -m $g -ngl 99 -fa 1 -p 0 -n 256 -d 16384 -r 2 -o json > $out/p16.json 2>/dev/null; pj $out/p16.json | tee -a $O/log.txt
$C gpu --models $g --vocab none --reps 2 --only sessions --sessions 64 2>&1 | tail -1 | tee -a $O/log.txt
timeout 120 $P/llama-batched-bench -m $g -ngl 99 -fa on -c $((64 * 1152)) -b 2048 -ub 512 -npp 1024 -ntg 128 -npl 64 --output-format jsonl 2>/dev/null | grep -v '^$' | tail -1 | tee -a $O/log.txt
echo "== qwen3-8b q4_k_m ($(el))"
measure_round 1 qwen3-8b-q4_k_m $q /tmp/vocab/ggml-vocab-qwen2.gguf
python3 $repo/bench/peer/side_by_side.py $out "qwen3-8b-q4_k_m" 1 | tee $O/table-qwen3.md
cp $out/combs-qwen3-8b-q4_k_m-1.md $O/ 2>/dev/null
tar czf $O/sbs-raw.tar.gz -C $out --exclude='*.gguf' . 
echo "# end $(el)"
