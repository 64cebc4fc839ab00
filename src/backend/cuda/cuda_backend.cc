#include "combs/backend/cuda/cuda_backend.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "combs/backend/cuda/cuda_ops.h"
#include "cuda_check.h"

namespace combs {

struct CudaBackend::Impl {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  cudaDeviceProp prop{};
  void* scratch[kScratchSlots] = {};
  size_t scratch_bytes[kScratchSlots] = {};
  std::vector<char> last_upload[kScratchSlots];
  uint64_t generation = 0;
  void* cublas_workspace = nullptr;
};

// cuBLAS's workspace, set once so that cuBLAS never allocates inside a captured CUDA graph.
constexpr size_t kCublasWorkspaceBytes = 32u << 20;

int CudaBackend::device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) == cudaSuccess) return n;
  cudaGetLastError();  // handled here: not left for the next cudaGetLastError() to report
  return 0;
}

StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::create(CudaBackendOptions options) {
  const int n = device_count();
  if (options.device < 0 || options.device >= n) {
    return unavailable_error("cuda: device " + std::to_string(options.device) + " does not exist (" +
                             std::to_string(n) + " CUDA devices)");
  }
  auto impl = std::make_unique<Impl>();
  impl->device = options.device;
  COMBS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  COMBS_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&impl->prop, options.device));
  COMBS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking));
  if (Status s = cuda::cublas_status(cublasCreate(&impl->cublas), "cublasCreate"); !s.ok()) {
    cudaStreamDestroy(impl->stream);
    return s;
  }
  cublasSetStream(impl->cublas, impl->stream);
  if (cudaError_t e = cudaMalloc(&impl->cublas_workspace, kCublasWorkspaceBytes); e != cudaSuccess) {
    cudaGetLastError();
    cublasDestroy(impl->cublas);
    cudaStreamDestroy(impl->stream);
    return cuda::cuda_status(e, "cudaMalloc(cuBLAS workspace)");
  }
  cublasSetWorkspace(impl->cublas, impl->cublas_workspace, kCublasWorkspaceBytes);
  return std::unique_ptr<CudaBackend>(new CudaBackend(std::move(impl)));
}

CudaBackend::CudaBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CudaBackend::~CudaBackend() {
  cudaSetDevice(impl_->device);
  cudaStreamSynchronize(impl_->stream);
  for (void* p : impl_->scratch)
    if (p) cudaFree(p);
  cublasDestroy(impl_->cublas);
  cudaFree(impl_->cublas_workspace);
  cudaStreamDestroy(impl_->stream);
}

std::string CudaBackend::description() const {
  char buf[512];
  std::snprintf(buf, sizeof buf, "%s (sm_%d%d, %.0f GiB)", impl_->prop.name, impl_->prop.major, impl_->prop.minor,
                static_cast<double>(impl_->prop.totalGlobalMem) / (1 << 30));
  return buf;
}

void* CudaBackend::stream() const { return impl_->stream; }
void* CudaBackend::cublas() const { return impl_->cublas; }

uint64_t CudaBackend::scratch_generation() const { return impl_->generation; }

StatusOr<void*> CudaBackend::scratch(size_t bytes, int slot) {
  if (slot < 0 || slot >= kScratchSlots) return invalid_argument_error("cuda scratch: no slot " + std::to_string(slot));
  if (bytes > impl_->scratch_bytes[slot]) {
    COMBS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(impl_->stream));  // the old scratch may be in use
    ++impl_->generation;
    if (impl_->scratch[slot]) cudaFree(impl_->scratch[slot]);
    impl_->scratch[slot] = nullptr;
    impl_->scratch_bytes[slot] = 0;
    impl_->last_upload[slot].clear();
    // The size asked for, at least 64 KB. (Growing by half again, so that a slowly growing user
    // such as the page tables moves it rarely, was meant here but never ran: the old size was
    // already cleared. Not changed until a GPU run can measure the slots' memory with it.)
    bytes = std::max(bytes, size_t{64} << 10);
    if (cudaError_t e = cudaMalloc(&impl_->scratch[slot], bytes); e != cudaSuccess) {
      cudaGetLastError();
      return cuda::cuda_status(e, "cudaMalloc(scratch)");
    }
    impl_->scratch_bytes[slot] = bytes;
    // Zeroed on this backend's stream (a non-blocking one: a plain cudaMemset, on the legacy
    // stream, is not ordered before its kernels), which the split counters in the scratch rely on.
    COMBS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(impl_->scratch[slot], 0, bytes, impl_->stream));
  }
  return impl_->scratch[slot];
}

StatusOr<void*> CudaBackend::upload(int slot, const void* host, size_t bytes) {
  COMBS_ASSIGN_OR_RETURN(void* dev, scratch(bytes, slot));
  std::vector<char>& last = impl_->last_upload[slot];
  if (last.size() == bytes && std::memcmp(last.data(), host, bytes) == 0) return dev;
  // From pageable memory: the call returns once the bytes are staged, so `host` may change after.
  COMBS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, impl_->stream));
  last.assign(static_cast<const char*>(host), static_cast<const char*>(host) + bytes);
  return dev;
}

Status CudaBackend::synchronize() {
  COMBS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(impl_->stream));
  return ok_status();
}

Status CudaBackend::copy(const Tensor& src, const Tensor& dst) {
  if (src.dtype() != dst.dtype() || src.numel() != dst.numel()) {
    return invalid_argument_error("cuda copy: " + src.shape().to_string() + " to " + dst.shape().to_string() +
                                  " (dtype or size differ)");
  }
  // (Any thread may call: a tensor-parallel pool's shards copy pages from the engine's thread.)
  COMBS_CUDA_RETURN_IF_ERROR(cudaSetDevice(impl_->device));
  COMBS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDefault, impl_->stream));
  return synchronize();
}

Status CudaBackend::zero(const Tensor& t) {
  COMBS_CUDA_RETURN_IF_ERROR(cudaSetDevice(impl_->device));
  COMBS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(t.data(), 0, t.nbytes(), impl_->stream));
  return synchronize();
}

std::optional<int64_t> CudaBackend::free_memory_bytes() const {
  size_t free = 0, total = 0;
  if (cudaSetDevice(impl_->device) != cudaSuccess || cudaMemGetInfo(&free, &total) != cudaSuccess) {
    cudaGetLastError();
    return std::nullopt;
  }
  return static_cast<int64_t>(free);
}

void* CudaBackend::raw_alloc(size_t bytes) {
  void* p = nullptr;
  // On this backend's device whatever the calling thread's current one is (a tensor-parallel
  // pool allocates every shard's arenas from one thread).
  if (cudaSetDevice(impl_->device) == cudaSuccess && cudaMalloc(&p, bytes) == cudaSuccess) return p;
  cudaGetLastError();  // the caller reports RESOURCE_EXHAUSTED; clear the runtime's last error
  return nullptr;
}

void CudaBackend::raw_free(void* ptr) noexcept {
  cudaSetDevice(impl_->device);
  cudaFree(ptr);
}

void* CudaBackend::raw_alloc_host(size_t bytes) {
  void* p = nullptr;
  if (cudaSetDevice(impl_->device) != cudaSuccess ||
      cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  // With unified addressing (every 64-bit platform CUDA 13 runs on) the device addresses mapped
  // host memory at its host pointer; copy_chunks() relies on it.
  void* dev = nullptr;
  if (cudaHostGetDevicePointer(&dev, p, 0) != cudaSuccess || dev != p) {
    cudaGetLastError();
    cudaFreeHost(p);
    return nullptr;
  }
  return p;
}

void CudaBackend::raw_free_host(void* ptr) noexcept { cudaFreeHost(ptr); }

Status CudaBackend::copy_chunks(std::span<const CopyChunk> chunks, size_t bytes) {
  if (chunks.empty() || bytes == 0) return ok_status();
  COMBS_ASSIGN_OR_RETURN(void* list, upload(kCopySlot, chunks.data(), chunks.size_bytes()));
  COMBS_RETURN_IF_ERROR(cuda::copy_chunks(*this, static_cast<const CopyChunk*>(list), static_cast<int64_t>(chunks.size()), bytes));
  return synchronize();
}

}  // namespace combs
