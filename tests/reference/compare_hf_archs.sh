#!/bin/bash
# usage (on the GPU machine, where torch and transformers are): tests/reference/compare_hf_archs.sh BIN_DIR
# Every architecture's tiny shape (the mixtures of experts too), f32 and bf16 weights: combs-mkmodel writes the file,
# combs-generate (CPU, f32 K/V) the logits of a 48-token prompt (past every tiny shape's 8-key
# window), compare_hf.py the same weights in transformers (float32, eager attention). One line per
# file and PASS/FAIL; exit status 1 if any failed. SHAPES (a list) takes some shapes only.
set -u
bin=${1:?usage: compare_hf_archs.sh BIN_DIR}
here=$(cd "$(dirname "$0")" && pwd)
dir=$(mktemp -d)
ids=$(python3 -c 'print(" ".join(str((i * 37 + 11) % 259) for i in range(48)))')  # every vocabulary's
fail=0
for shape in ${SHAPES:-tiny qwen2-tiny qwen3-tiny gemma2-tiny gemma3-tiny llama-yarn-tiny phi3-tiny qwen3moe-tiny qwen2moe-tiny mixtral-tiny gpt-oss-tiny}; do
  for type in f32 bf16; do
    f=$dir/$shape-$type.gguf
    "$bin/combs-mkmodel" --shape "$shape" --dtype "$type" --seed 5 --out "$f" > /dev/null 2>&1 || { echo "$shape $type: combs-mkmodel failed"; fail=1; continue; }
    "$bin/combs-generate" --model "$f" --prompt-ids "$ids" --ids --max-tokens 1 --temperature 0 --kv-dtype f32 \
      --logits-out "$f.logits" > /dev/null 2> "$f.log" || { echo "$shape $type: combs-generate failed: $(tail -n 2 "$f.log")"; fail=1; continue; }
    out=$(python3 "$here/compare_hf.py" --gguf "$f" --logits "$f.logits" --ids "$ids" 2>&1); rc=$?
    echo "$out" | tail -n 2 | tr '\n' ' '; echo
    [ $rc = 0 ] || fail=1
  done
done
rm -rf "$dir"
exit $fail
