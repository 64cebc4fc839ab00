#!/bin/bash
# usage (on the GPU machine, through the device tool with carry [".gpu"]):
#   bench/gpu/side_by_side.sh [ROUNDS] [SHAPES] [VARIANT] [TYPE]
#   e.g. bench/gpu/side_by_side.sh 2 llama-1b,llama-8b main Q4_K_M
# combs and the peer (llama.cpp, built there from node-llama-cpp's bundled source) on the same GGUF
# files (random BF16 weights, each shape's real vocabulary (vocab_of); with TYPE, those files quantized
# by the peer's llama-quantize to TYPE, e.g. Q4_K_M, its own per-tensor mix), in one run of one
# machine (FIRST_ROUND=K in the environment resumes at round K on a warm machine):
#   one session's decode   combs: 256 new after a 128-token prompt   llama-bench -p 0 -n 256 -d 128
#   prefill of 2,048       combs: one 2,048-token prompt             llama-bench -p 2048 -n 0, fastest -ub
#   64 sessions            combs: 64 x 1,024-token prompts, 128 new  llama-batched-bench -npp 1024 -ntg 128 -npl 64
# Needs, packed here: .gpu/libs (../shared/gpu/pack-libs.sh; unpack.sh unpacks them), .gpu/VARIANT/combs-bench.xz
# (bench/gpu/pack.sh VARIANT) and .gpu/llama-src.tar.xz (bench/peer/build.sh tarball). Steps, each
# skipped where its output exists (a second call on a warm machine resumes): the peer's CUDA build
# (build/peer), the models (build/models, written while the peer builds), then ROUNDS rounds of
# every measurement of both programs, alternating per shape. Raw outputs go to /tmp/side-by-side,
# packed into $OUT/side-by-side-raw.tar.gz at the end (the device tool brings back few files); the
# table (medians over rounds; ratio = combs / peer) is printed last and kept as $OUT/table.md.
set -u
ROUNDS=${1:-2}; SHAPES=${2:-llama-1b,llama-8b}; V=${3:-main}; TYPE=${4:-BF16}
here=$(cd "$(dirname "$0")" && pwd); repo=$(cd "$here/../.." && pwd)
out=/tmp/side-by-side; mkdir -p "$out"
export PEER_DIR=$repo/build/peer
models=$repo/build/models
# Each shape's real vocabulary: Llama 3's for llama, Qwen2's for qwen3 (151,646 tokens), Gemma 4's
# for gemma3 (262,144 tokens, Gemma 3's size); those two from tests/data/vocab/more-vocabs.tar.xz.
mkdir -p /tmp/vocab && tar xJf "$repo/tests/data/vocab/more-vocabs.tar.xz" -C /tmp/vocab ggml-vocab-qwen2.gguf ggml-vocab-gemma-4.gguf
vocab_of() {
  case $1 in
    qwen*) echo /tmp/vocab/ggml-vocab-qwen2.gguf ;;
    gemma*) echo /tmp/vocab/ggml-vocab-gemma-4.gguf ;;
    *) echo "$repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf" ;;
  esac
}
mkdir -p "$models"
cd "$repo" && . bench/gpu/unpack.sh "$V"
[ -x /tmp/bin/$V/combs-bench ] || { echo "no .gpu/$V/combs-bench.xz (bench/gpu/pack.sh $V)"; exit 1; }
combs=/tmp/bin/$V/combs-bench
. "$here/side_by_side_round.sh"

t0=$(date +%s)
peer_bin=$PEER_DIR/build-cuda/bin
if [ ! -x "$peer_bin/llama-batched-bench" ]; then
  (bash "$repo/bench/peer/build.sh" cuda "$repo/.gpu/llama-src.tar.xz" > "$out/peer-build.log" 2>&1;
   echo "peer build exit $? after $(( $(date +%s) - t0 )) s" >> "$out/peer-build.log") &
  build_pid=$!
fi
rm -f "$out/models.txt"
for s in ${SHAPES//,/ }; do
  "$combs" gpu --only models --shapes "$s" --dir "$models" --vocab "$(vocab_of "$s")" >> "$out/models.txt" || exit 1
done
echo "# models written after $(( $(date +%s) - t0 )) s: $(awk '{print $2}' "$out/models.txt" | tr '\n' ' ')"
if [ -n "${build_pid:-}" ]; then wait "$build_pid"; tail -n 3 "$out/peer-build.log"; fi
[ -x "$peer_bin/llama-batched-bench" ] || { echo "the peer did not build: $out/peer-build.log"; exit 1; }

# The files measured, one label each: the BF16 models, or their TYPE quantizations.
labels=""; rm -f "$out/files.txt.tmp"
while read -r s m; do
  if [ "$TYPE" != BF16 ]; then
    q=$models/$s.$TYPE.gguf
    if [ ! -s "$q" ]; then
      "$peer_bin/llama-quantize" "$m" "$q.tmp" "$TYPE" 16 > "$out/quantize-$s.log" 2>&1 && mv "$q.tmp" "$q" ||
        { echo "llama-quantize $s $TYPE failed: $(tail -n 3 "$out/quantize-$s.log")"; exit 1; }
      echo "# $s quantized to $TYPE after $(( $(date +%s) - t0 )) s: $(du -h "$q" | cut -f1)"
    fi
    s=$s.$TYPE; m=$q
  fi
  echo "$s $m" >> "$out/files.txt.tmp"; labels=$labels${labels:+,}$s
done < "$out/models.txt"
mv "$out/files.txt.tmp" "$out/files.txt"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > "$out/gpu.txt"
for r in $(seq "${FIRST_ROUND:-1}" "$ROUNDS"); do
  for s in ${labels//,/ }; do
    m=$(awk -v s="$s" '$1 == s { print $2 }' "$out/files.txt")
    measure_round "$r" "$s" "$m" "$(vocab_of "$s")"
  done
done
echo "# done after $(( $(date +%s) - t0 )) s"
python3 "$here/../peer/side_by_side.py" "$out" "$labels" "$ROUNDS" | tee "$out/table.md"
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/side-by-side-raw.tar.gz" -C "$out" . && cp "$out/table.md" "$OUT/table.md"
fi
