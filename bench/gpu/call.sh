# Sourced first by a device call's script (bench/raw/<session>/call*-run.sh), run in the repo root on
# the GPU machine: `. bench/gpu/call.sh VARIANT...`. Unpacks what .gpu carries (Llama 3's vocabulary
# as tests/data/vocab/ggml-vocab-llama-bpe.gguf; llama.cpp's presets into tests/data/models/presets
# where .gpu/voc/presets.tar.xz is carried; the libraries and each VARIANT's binaries, unpack.sh) and
# sets: repo, O (the call's $OUT), el (seconds since the call began), V (the vocabulary's path),
# models (a folder in /dev/shm for the models the call writes); the GPU's name goes first in
# $O/log.txt.
repo=$PWD
O=${OUT:-/tmp}; t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))"; }
mkdir -p tests/data/vocab
[ -e .gpu/voc/ggml-vocab-llama-bpe.gguf.xz ] && xz -dc .gpu/voc/ggml-vocab-llama-bpe.gguf.xz > tests/data/vocab/ggml-vocab-llama-bpe.gguf
[ -e .gpu/voc/presets.tar.xz ] && mkdir -p tests/data/models && tar -xJf .gpu/voc/presets.tar.xz -C tests/data/models
V=$repo/tests/data/vocab/ggml-vocab-llama-bpe.gguf
. bench/gpu/unpack.sh "$@"
models=/dev/shm/combs-models; mkdir -p $models
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $O/log.txt
