// Registers the CUDA kernels of attention_batch() (KV caches whose pool lives on a CudaBackend).
// Idempotent; CudaRunner::create calls it, as must any other user of CUDA caches.
#pragma once

namespace combs {

void register_cuda_attention();

}  // namespace combs
