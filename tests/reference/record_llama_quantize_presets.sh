#!/usr/bin/env bash
# llama.cpp's own quantization presets on random models, and its greedy continuations on them: the
# reference of runner_test.cc's "llama.cpp's quantization presets" test.
#   tests/reference/record_llama_quantize_presets.sh BUILD_DIR [LLAMA_QUANTIZE]
# combs-mkmodel (BUILD_DIR/bin) writes each shape in f16; llama.cpp v0.5.0's llama-quantize
# (PEER_TARGETS=llama-quantize bench/peer/build.sh cpu) makes every preset of it — its per-tensor
# mixes, and on qwen2-tiny-384 (rows of 384 and 640) its fallbacks for rows that are not whole
# 256-wide K-quant blocks — into tests/data/models/presets/; node-llama-cpp 3.22.1's prebuilt CPU
# binaries (bench/peer: npm install) give the greedy continuations (24 tokens, context 512), written
# to tests/data/models/presets/llama_cpp_greedy.txt with each file's tensor types.
set -euo pipefail
build=${1:?usage: record_llama_quantize_presets.sh BUILD_DIR [LLAMA_QUANTIZE]}
quantize=${2:-$HOME/.cache/combs-peer/build-cpu/bin/llama-quantize}
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=$root/tests/data/models/presets
out=$dir/llama_cpp_greedy.txt
mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prompts=("1 5 9 200 17 33 101 250 7 64 12 99" "2 77 130 91 14 201 33 180 5 66 240 17 88 123 9 44")
all="Q4_K_M Q5_K_M Q6_K Q4_0 Q4_1 IQ4_XS Q3_K_M Q2_K"
{
  echo "# llama.cpp v0.5.0's llama-quantize presets of combs-mkmodel f16 files, and its greedy continuations on"
  echo "# them (24 tokens, node-llama-cpp 3.22.1 prebuilt CPU binaries, context 512):"
  echo "# tests/reference/record_llama_quantize_presets.sh ($(date -u +%F))."
  echo "# file|tensor types (gguf-py's names, count)|prompt ids|continuation ids"
  # shape:seed:layers:presets (qwen2's of one layer: the files are kept in the repo, ~0.5-1 MB each)
  for spec in "tiny:31:2:$all" "qwen2-tiny:32:1:$all" "qwen2-tiny-384:33:1:Q4_K_M Q6_K IQ4_XS Q2_K"; do
    IFS=: read -r shape seed layers presets <<< "$spec"
    "$build/bin/combs-mkmodel" --shape "$shape" --dtype f16 --seed "$seed" --layers "$layers" \
      --out "$tmp/$shape-f16.gguf" >/dev/null
    for p in $presets; do
      name=$shape-$(echo "$p" | tr 'A-Z' 'a-z').gguf
      "$quantize" "$tmp/$shape-f16.gguf" "$dir/$name" "$p" 2 > "$tmp/quantize.log" 2>&1 ||
        { cat "$tmp/quantize.log" >&2; exit 1; }
      types=$(python3 - "$dir/$name" <<'PY'
import struct, sys, collections
# The tensor types of a GGUF (v3) file from its header: ggml type ids counted by name.
names = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
         12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL", 23: "IQ4_XS", 30: "BF16", 39: "MXFP4"}
f = open(sys.argv[1], "rb")
magic, version, n_tensors, n_kv = struct.unpack("<IIQQ", f.read(24))
def string(): return f.read(struct.unpack("<Q", f.read(8))[0])
sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
def value(t):
    if t == 8: string()
    elif t == 9:
        et, n = struct.unpack("<IQ", f.read(12))
        for _ in range(n): value(et)
    else: f.read(sizes[t])
for _ in range(n_kv):
    string(); value(struct.unpack("<I", f.read(4))[0])
count = collections.Counter()
for _ in range(n_tensors):
    string(); nd = struct.unpack("<I", f.read(4))[0]; f.read(8 * nd)
    t = struct.unpack("<I", f.read(4))[0]; f.read(8)
    count[names.get(t, str(t))] += 1
print(" ".join(f"{k}:{v}" for k, v in sorted(count.items())))
PY
)
      for prompt in "${prompts[@]}"; do
        ids=$(cd "$root/bench/peer" && node llama_cpp.mjs greedy "$dir/$name" "$prompt" 24 2>/dev/null | tail -1)
        echo "$name|$types|$prompt|$ids"
      done
    done
  done
} > "$out.tmp"
mv "$out.tmp" "$out"
echo "wrote $out ($(du -sh "$dir" | cut -f1))"
