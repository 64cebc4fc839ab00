#!/bin/bash
# usage (on a GPU machine, through the device tool with carry [".gpu"]):
#   bench/gpu/tp.sh VARIANT [tests|all-tests] ["SHAPE:DTYPE ..." TPS REPS]
#   e.g. bench/gpu/tp.sh tp tests "llama-8b:bf16 llama-8b:q4_k_m" "1 2 4" 3
# Tensor parallelism (issue 29): NCCL found in the PyTorch image's nvidia-nccl wheel, NVLink
# multicast kept off in every process started here; then the tensor-parallel [cuda] tests (two
# ranks on one GPU always; NCCL over every GPU the machine has), with "all-tests" every [cuda]
# test; then `combs-bench gpu --tensor-parallel N` for each N of TPS that the GPUs allow, one
# session's decode and SESSIONS sessions, Llama 3's vocabulary. Logs and reports go to $OUT.
set -u
V=$1; WHAT=${2:-tests}; MODELS=${3:-}; TPS=${4:-1}; REPS=${5:-3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
. "$(dirname "$0")/unpack.sh" $V
O=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
GPUS=$(nvidia-smi -L | wc -l)
nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
if [ -n "$nccl" ] && [ -e "$nccl" ]; then export COMBS_NCCL_LIBRARY=$nccl; fi
echo "GPUs: $GPUS; NCCL: ${COMBS_NCCL_LIBRARY:-not found}"
[ "$GPUS" -gt 1 ] && nvidia-smi topo -m 2>&1 | head -12
T=/tmp/bin/$V/combs_cuda_tests
if [ "$WHAT" != none ] && [ -x $T ]; then
  echo "== tensor-parallel [cuda] tests"
  timeout 400 $T "*tensor*,*nccl*,models that do not split*" -d yes > $O/tp-tests.log 2>&1
  echo "exit $?"; grep -E "^[0-9.]+ s: |passed|failed|FAILED" $O/tp-tests.log | tail -14
  if [ "$WHAT" = all-tests ]; then
    echo "== every [cuda] test"
    timeout 400 $T > $O/cuda-tests.log 2>&1
    echo "exit $?"; tail -4 $O/cuda-tests.log
  fi
fi
for tp in $TPS; do
  [ "$tp" -gt "$GPUS" ] && { echo "== TP$tp skipped: $GPUS GPUs"; continue; }
  for m in $MODELS; do
    shape=${m%%:*}; dtype=${m##*:}
    echo "== TP$tp $shape $dtype"
    timeout 500 /tmp/bin/$V/combs-bench gpu --shapes "$shape" --dtypes "$dtype" --tensor-parallel "$tp" \
      --vocab tests/data/vocab/ggml-vocab-llama-bpe.gguf --dir /tmp/models --reps "$REPS" --sessions 64 \
      2>&1 | tee "$O/gpu-tp$tp-$shape-$dtype.md" | grep -E "^\|" | tail -4
  done
done
