#!/bin/bash
# usage: bench/peer/cpu_side_by_side.sh [ROUNDS] [THREADS] [SHAPE] [DTYPES]   (default 3 2 llama-1b bf16,q8_0)
#        MODELS=a.gguf,b.gguf bench/peer/cpu_side_by_side.sh [ROUNDS] [THREADS]  (given files instead)
# combs and the peer (llama.cpp, bench/peer/build.sh cpu) on this CPU, on the same GGUF files
# (random weights, Llama 3's 128,256-token vocabulary, written by combs-bench), interleaved:
# each round runs, per weight type, combs then the peer.
#   prompt   combs-bench model --prompt 512            llama-bench -p 512 -n 0
#   decode   combs-bench model --gen 128 (after 512)   llama-bench -p 0 -n 128 -d 512
# COMBS_BENCH (default build/release/bin/combs-bench) and PEER_DIR (default ~/.cache/combs-peer) name
# the two programs. Raw outputs go to OUT (default /tmp/cpu-side-by-side); the table is printed last.
set -u
ROUNDS=${1:-3}; THREADS=${2:-2}; SHAPE=${3:-llama-1b}; DTYPES=${4:-bf16,q8_0}
here=$(cd "$(dirname "$0")" && pwd); repo=$(cd "$here/../.." && pwd)
combs=${COMBS_BENCH:-$repo/build/release/bin/combs-bench}
peer=${PEER_DIR:-$HOME/.cache/combs-peer}/build-cpu/bin/llama-bench
out=${OUT:-/tmp/cpu-side-by-side}; mkdir -p "$out"
dir=/tmp/combs-bench-models
[ -x "$combs" ] && [ -x "$peer" ] || { echo "need $combs and $peer (bench/peer/build.sh cpu)" >&2; exit 1; }
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-400 > "$out/cpu.txt"
# MODELS (comma-separated GGUF files, e.g. llama-quantize's) are measured instead of SHAPE's DTYPES.
jobs=()
if [ -n "${MODELS:-}" ]; then
  for m in ${MODELS//,/ }; do jobs+=("$(basename "$m" .gguf)=--models $m"); done
else
  for d in ${DTYPES//,/ }; do jobs+=("$d=--shapes $SHAPE --dtypes $d --dir $dir"); done
fi
labels=$(for j in "${jobs[@]}"; do printf '%s,' "${j%%=*}"; done)
for r in $(seq "$ROUNDS"); do
  for j in "${jobs[@]}"; do
    d=${j%%=*}
    echo "# round $r $d: combs"
    # shellcheck disable=SC2086  # the job's flags split on purpose
    "$combs" model ${j#*=} --threads "$THREADS" --prompt 512 --gen 128 --reps 3 \
      > "$out/combs-$d-$r.md" 2> "$out/combs-$d-$r.log" || { cat "$out/combs-$d-$r.log"; exit 1; }
    m=$(sed -n 's/^combs-bench model: //p' "$out/combs-$d-$r.log" | head -n1)
    echo "# round $r $d: peer on $m"
    "$peer" -m "$m" -t "$THREADS" -p 512 -n 0 -r 3 -o json > "$out/peer-prompt-$d-$r.json" 2> "$out/peer-prompt-$d-$r.log"
    "$peer" -m "$m" -t "$THREADS" -p 0 -n 128 -d 512 -r 3 -o json > "$out/peer-decode-$d-$r.json" 2> "$out/peer-decode-$d-$r.log"
  done
done
python3 "$here/side_by_side.py" --cpu "$out" "${labels%,}" "$ROUNDS" | tee "$out/table.md"
