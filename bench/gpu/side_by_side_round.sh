# Sourced by side_by_side.sh and moe.sh: one round of the side-by-side measurements on one file,
#   measure_round ROUND LABEL MODEL VOCAB
# combs (combs-bench gpu: one session's decode, prefill of 2,048, 64 sessions) then the peer
# (llama-bench decode 256 after 128; prefill 2,048 at the -ub values; llama-batched-bench 64 x
# (1,024 + 128)), raw outputs into $out as side_by_side.py reads them. Needs combs, peer_bin, out
# and t0 set by the caller.
measure_round() {
  local r=$1 s=$2 m=$3 vocab=$4
  echo "# round $r $s: combs ($(( $(date +%s) - t0 )) s)"
  "$combs" gpu --models "$m" --vocab "$vocab" --reps 3 --sessions 64 --attention-contexts "" \
    > "$out/combs-$s-$r.md" 2>&1
  echo "# round $r $s: peer ($(( $(date +%s) - t0 )) s)"
  "$peer_bin/llama-bench" -m "$m" -ngl 99 -fa 1 -p 0 -n 256 -d 128 -r 3 -o json > "$out/peer-decode-$s-$r.json" 2> "$out/peer-decode-$s-$r.log"
  "$peer_bin/llama-bench" -m "$m" -ngl 99 -fa 1 -p 2048 -n 0 -b 2048 -ub 512,1024,2048 -r 3 -o json \
    > "$out/peer-prefill-$s-$r.json" 2> "$out/peer-prefill-$s-$r.log"
  "$peer_bin/llama-batched-bench" -m "$m" -ngl 99 -fa on -c $((64 * (1024 + 128))) -b 2048 -ub 512 \
    -npp 1024 -ntg 128 -npl 64 --output-format jsonl > "$out/peer-sessions-$s-$r.jsonl" 2> "$out/peer-sessions-$s-$r.log"
}
