#!/bin/bash
# usage (on the GPU machine, through the device tool with carry [".gpu"]), two calls back to back
# (the second within the machine's 30 s warm time):
#   bench/gpu/moe.sh start [VARIANT]            the [cuda] tests and the experts' logits against transformers,
#                                               while the peer's CUDA build and the model file are made in
#                                               the background (setsid); waits for them up to START_WAIT s
#   bench/gpu/moe.sh bench [VARIANT] [ROUNDS]   waits for both, then ROUNDS rounds of combs and the peer
# The mixture-of-experts benchmark of issue 25: the qwen3-30b-a3b shape (48 layers, 128 experts,
# 8 chosen, experts 768 wide) in Q4_K_M as combs-mkmodel quantizes it (llama.cpp's mix), with
# Qwen2's vocabulary (151,646 tokens), the same file for both programs; the measurements are
# side_by_side_round.sh's (one session's decode, prefill of 2,048, 64 sessions), the table its
# side_by_side.py's. Needs .gpu/libs, .gpu/VARIANT/{combs-bench,combs_cuda_tests}.xz and
# .gpu/llama-src.tar.xz, as side_by_side.sh.
set -u
PHASE=${1:?start or bench}; V=${2:-main}; ROUNDS=${3:-2}
here=$(cd "$(dirname "$0")" && pwd); repo=$(cd "$here/../.." && pwd)
cd "$repo"
. bench/gpu/unpack.sh "$V"
out=/tmp/side-by-side; mkdir -p "$out"
export PEER_DIR=$repo/build/peer
# The 18.56 GB file goes to /dev/shm (the machine's 128 GB of memory): its disk took ~13 minutes of
# the first device call to take it (about 20 MB/s), where /dev/shm took a 1.19 GB file in under one.
models=${MODELS_DIR:-/dev/shm/combs-models}; mkdir -p "$models"
peer_bin=$PEER_DIR/build-cuda/bin
shape=qwen3-30b-a3b; type=q4_k_m
mkdir -p /tmp/vocab && tar xJf tests/data/vocab/more-vocabs.tar.xz -C /tmp/vocab ggml-vocab-qwen2.gguf
vocab=/tmp/vocab/ggml-vocab-qwen2.gguf
combs=/tmp/bin/$V/combs-bench
. "$here/side_by_side_round.sh"
t0=$(date +%s)
if [ "$PHASE" = start ]; then
  setsid bash -c "bash '$repo/bench/peer/build.sh' cuda '$repo/.gpu/llama-src.tar.xz' > '$out/peer-build.log' 2>&1;
                  echo \$? > '$out/peer-build.rc'" < /dev/null > /dev/null 2>&1 &
  setsid bash -c "'$combs' gpu --only models --shapes $shape --dtypes $type --dir '$models' --vocab '$vocab' > '$out/models.txt' 2> '$out/models.log';
                  echo \$? > '$out/models.rc'" < /dev/null > /dev/null 2>&1 &
  /tmp/bin/$V/combs_cuda_tests "[cuda]" 2>&1 | tail -n "${TAIL:-40}"
  echo "# tests done after $(( $(date +%s) - t0 )) s"
  # The mixtures of experts' logits against transformers (CPU, f32 and bf16 weights).
  SHAPES="qwen3moe-tiny qwen2moe-tiny mixtral-tiny gpt-oss-tiny" timeout 240 bash tests/reference/compare_hf_archs.sh /tmp/bin/$V
  echo "# transformers done after $(( $(date +%s) - t0 )) s"
  # Wait here (up to START_WAIT s from the start) so that the bench call has only measuring left.
  while { [ ! -e "$out/peer-build.rc" ] || [ ! -e "$out/models.rc" ]; } && [ $(( $(date +%s) - t0 )) -lt "${START_WAIT:-560}" ]; do sleep 5; done
  echo "# after $(( $(date +%s) - t0 )) s: peer build rc $(cat "$out/peer-build.rc" 2>/dev/null || echo running), models rc $(cat "$out/models.rc" 2>/dev/null || echo running)"
  ls -la "$models"
  exit 0
fi
while [ ! -e "$out/peer-build.rc" ] || [ ! -e "$out/models.rc" ]; do sleep 5; done
echo "# waited $(( $(date +%s) - t0 )) s: peer build rc $(cat "$out/peer-build.rc"), models rc $(cat "$out/models.rc")"
tail -n 3 "$out/peer-build.log"; cat "$out/models.log" "$out/models.txt"
read -r label m < "$out/models.txt"
[ -s "$m" ] && [ -x "$peer_bin/llama-batched-bench" ] || exit 1
echo "$label $m" > "$out/files.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > "$out/gpu.txt"
for r in $(seq 1 "$ROUNDS"); do
  measure_round "$r" "$label" "$m" "$vocab"
  tail -n 2 "$out/combs-$label-$r.md"
done
echo "# done after $(( $(date +%s) - t0 )) s"
python3 "$here/../peer/side_by_side.py" "$out" "$label" "$ROUNDS" | tee "$out/table.md"
if [ -n "${OUT:-}" ]; then
  rm -f "$out"/*.rc
  tar czf "$OUT/moe-raw.tar.gz" -C "$out" . && cp "$out/table.md" "$OUT/table.md"
fi
