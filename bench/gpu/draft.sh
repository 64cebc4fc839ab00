#!/bin/bash
# usage (on the GPU machine, through the device tool with carry [".gpu"]):
#   bench/gpu/draft.sh VARIANT "SHAPE ..." DRAFT_TYPE MAX_DRAFT ROUNDS
#   e.g. bench/gpu/draft.sh main "llama-8b llama-1b" q4_0 4 3
# Speculative decoding with a draft model, combs and the peer on the same pair of files: each
# shape's random BF16 model (Llama 3's vocabulary) as the target and the same weights in
# DRAFT_TYPE (written by combs-bench) as the draft.
#   combs:  combs-bench spec --device cuda --shape S --dtype bf16 --draft-dtype T (no speculation,
#           replayed drafts 30% wrong, n-gram, the draft model; 64-token prompt, 256 greedy tokens)
#   peer:   llama-bench -p 0 -n 256 -d 64 on the target and on the draft (no speculation), and
#           llama-speculative -m TARGET -md DRAFT --draft-max MAX_DRAFT --temp 0 -n 256, ROUNDS runs
# Needs, packed here: .gpu/libs, .gpu/VARIANT (bench/gpu/pack.sh) and .gpu/llama-src.tar.xz
# (bench/peer/build.sh tarball). The peer's build (build/peer) is kept on a warm machine, so a second
# call skips it. Raw outputs in $OUT.
set -u
V=$1; SHAPES=$2; DTYPE=$3; MAX_DRAFT=$4; ROUNDS=$5
repo=$(pwd)
. "$(dirname "$0")/unpack.sh" $V
out=${OUT:-/tmp/draft}; models=$repo/build/models; mkdir -p "$out" "$models"
export PEER_DIR=$repo/build/peer
peer_bin=$PEER_DIR/build-cuda/bin
t0=$(date +%s)
if [ ! -x "$peer_bin/llama-speculative" ]; then
  (bash bench/peer/build.sh cuda .gpu/llama-src.tar.xz > "$out/peer-build.log" 2>&1;
   echo "peer build exit $? after $(( $(date +%s) - t0 )) s" >> "$out/peer-build.log") &
  build_pid=$!
fi
vocab=tests/data/vocab/ggml-vocab-llama-bpe.gguf
combs=/tmp/bin/$V/combs-bench
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
for s in $SHAPES; do
  echo "== combs $s bf16, draft $DTYPE ($(( $(date +%s) - t0 )) s)"
  timeout 400 "$combs" spec --device cuda --shape "$s" --dtype bf16 --draft-dtype "$DTYPE" --vocab "$vocab" \
    --dir "$models" --prompt 64 --tokens 256 --max-draft "$MAX_DRAFT" --rounds "$ROUNDS" --errors 0.3 \
    2>&1 | tee "$out/combs-$s.md"
done
if [ -n "${build_pid:-}" ]; then wait "$build_pid"; fi
tail -n 2 "$out/peer-build.log" 2>/dev/null
[ -x "$peer_bin/llama-speculative" ] || { echo "the peer did not build: $out/peer-build.log"; exit 1; }
prompt="The history of the printing press begins in the fifteenth century, when movable type made books cheaper"
for s in $SHAPES; do
  tgt=$models/$s-bf16-ggml-vocab-llama-bpe.gguf
  dft=$models/$s-$DTYPE-ggml-vocab-llama-bpe.gguf
  echo "== peer $s ($(( $(date +%s) - t0 )) s)"
  for m in "$tgt" "$dft"; do
    "$peer_bin/llama-bench" -m "$m" -ngl 99 -fa 1 -p 0 -n 256 -d 64 -r "$ROUNDS" -o md 2> /dev/null | grep -E "tg256|model"
  done
  for r in $(seq 1 "$ROUNDS"); do
    "$peer_bin/llama-speculative" -m "$tgt" -md "$dft" -ngl 99 -ngld 99 -fa on -c 4096 --spec-draft-n-max "$MAX_DRAFT" \
      --temp 0 --ignore-eos -n 256 -p "$prompt" > "$out/peer-spec-$s-$r.txt" 2>&1
    grep -E "decoded|n_drafted|n_accept|accept " "$out/peer-spec-$s-$r.txt" | tr '\n' ' '; echo
  done
done
echo "done after $(( $(date +%s) - t0 )) s"
