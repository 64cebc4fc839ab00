#!/usr/bin/env bash
# Records llama.cpp's greedy continuations on random models of every architecture's tiny shape,
# written by combs-mkmodel, into tests/data/models/llama_cpp_arch_greedy.txt (the reference of
# runner_test.cc's teacher-forcing test, which writes the same files again and checks their hash).
# llama.cpp v0.5.0 through node-llama-cpp 3.22.1's prebuilt CPU binaries (bench/peer: npm install).
#   tests/reference/record_llama_cpp_greedy.sh BUILD_DIR
set -euo pipefail
build=${1:?usage: record_llama_cpp_greedy.sh BUILD_DIR (with bin/combs-mkmodel)}
root=$(cd "$(dirname "$0")/../.." && pwd)
out=$root/tests/data/models/llama_cpp_arch_greedy.txt
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prompts=("1 5 9 200 17 33 101 250 7 64 12 99" "3 100 42 7 250 66 12"
         "2 77 130 91 14 201 33 180 5 66 240 17 88 123 9 44 171 3 250 60")
{
  echo "# llama.cpp v0.5.0's greedy continuations (24 tokens, node-llama-cpp 3.22.1 prebuilt CPU binaries,"
  echo "# context 512) on combs-mkmodel files: tests/reference/record_llama_cpp_greedy.sh ($(date -u +%F))."
  echo "# shape|weight type|seed|FNV-1a 64 of the file|prompt ids|continuation ids"
  for shape in qwen3-tiny gemma2-tiny gemma3-tiny llama-yarn-tiny phi3-tiny qwen3moe-tiny qwen2moe-tiny mixtral-tiny \
               gpt-oss-tiny gemma3-swa-tiny; do
    types="f32 q8_0"
    case $shape in *moe-tiny|mixtral-tiny) types="f32 q8_0 q4_k_m";; esac  # experts arrive as Q4_K_M
    case $shape in gpt-oss-tiny) types="f32 q8_0 mxfp4_moe";; esac     # gpt-oss's as MXFP4
    for type in $types; do
      f=$tmp/$shape-$type.gguf
      "$build/bin/combs-mkmodel" --shape "$shape" --dtype "$type" --seed 21 --out "$f" >/dev/null 2>&1
      hash=$(python3 -c 'import sys
h = 0xcbf29ce484222325
for b in open(sys.argv[1], "rb").read(): h = ((h ^ b) * 0x100000001b3) & 0xffffffffffffffff
print("%016x" % h)' "$f")
      for p in "${prompts[@]}"; do
        ids=$(cd "$root/bench/peer" && node llama_cpp.mjs greedy "$f" "$p" 24 2>/dev/null | tail -1)
        echo "$shape|$type|21|$hash|$p|$ids"
      done
    done
  done
} > "$out.tmp"
mv "$out.tmp" "$out"
echo "wrote $out"
