// NCCL, loaded at run time (collective.h). combs declares the few parts of NCCL's C API it calls
// (the ABI NCCL keeps stable across 2.x: an opaque communicator, a 128-byte unique id, enums by
// value) and resolves them with dlsym, so nothing here needs nccl.h or libnccl at build time.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <glob.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "combs/backend/cuda/collective.h"

namespace combs {
namespace {

// NCCL's types, as its C API defines them.
using ncclComm_t = struct ncclComm*;
using ncclResult_t = int;  // 0: ncclSuccess, 7: ncclInProgress
constexpr ncclResult_t kNcclSuccess = 0, kNcclInProgress = 7;
constexpr int kNcclFloat32 = 7;  // ncclDataType_t
constexpr int kNcclSum = 0;      // ncclRedOp_t

struct NcclApi {
  void* handle = nullptr;
  std::string path;
  int version = 0;
  ncclResult_t (*GetVersion)(int*) = nullptr;
  ncclResult_t (*CommInitAll)(ncclComm_t*, int, const int*) = nullptr;
  ncclResult_t (*CommDestroy)(ncclComm_t) = nullptr;
  ncclResult_t (*CommAbort)(ncclComm_t) = nullptr;
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*) = nullptr;
  const char* (*GetErrorString)(ncclResult_t) = nullptr;
  ncclResult_t (*AllReduce)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*AllGather)(const void*, void*, size_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*GroupStart)() = nullptr;
  ncclResult_t (*GroupEnd)() = nullptr;

  Status error(ncclResult_t r, const char* call) const {
    return internal_error(std::string(call) + ": " + (GetErrorString ? GetErrorString(r) : "error") + " (NCCL " +
                          std::to_string(r) + ")");
  }
};

// Where libnccl.so.2 may be: the override, the loader's path, the nvidia-nccl wheels' folders.
std::vector<std::string> candidates() {
  if (const char* p = std::getenv("COMBS_NCCL_LIBRARY"); p && *p) return {p};
  std::vector<std::string> out{"libnccl.so.2"};
  for (const char* pattern : {"/usr/local/lib/python3*/dist-packages/nvidia/nccl/lib/libnccl.so.2",
                              "/usr/local/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2",
                              "/usr/lib/python3*/dist-packages/nvidia/nccl/lib/libnccl.so.2",
                              "/opt/conda/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2"}) {
    glob_t g{};
    if (glob(pattern, 0, nullptr, &g) == 0) {
      for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
    }
    globfree(&g);
  }
  return out;
}

// Loaded once per process; the error, if any, names every place tried.
const StatusOr<const NcclApi*>& nccl_api() {
  static const StatusOr<const NcclApi*> api = []() -> StatusOr<const NcclApi*> {
    static NcclApi a;
    std::string tried;
    for (const std::string& path : candidates()) {
      a.handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (a.handle) {
        a.path = path;
        break;
      }
      tried += (tried.empty() ? "" : ", ") + path;
    }
    if (!a.handle) {
      return unavailable_error("nccl: libnccl.so.2 not found (tried " + tried +
                               "; set COMBS_NCCL_LIBRARY to its path)");
    }
    bool missing = false;
    std::string which;
    auto sym = [&](auto*& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(a.handle, name));
      if (!fn) missing = true, which = name;
    };
    sym(a.GetVersion, "ncclGetVersion");
    sym(a.CommInitAll, "ncclCommInitAll");
    sym(a.CommDestroy, "ncclCommDestroy");
    sym(a.CommAbort, "ncclCommAbort");
    sym(a.CommGetAsyncError, "ncclCommGetAsyncError");
    sym(a.GetErrorString, "ncclGetErrorString");
    sym(a.AllReduce, "ncclAllReduce");
    sym(a.AllGather, "ncclAllGather");
    sym(a.GroupStart, "ncclGroupStart");
    sym(a.GroupEnd, "ncclGroupEnd");
    if (missing) return unavailable_error("nccl: " + a.path + " has no " + which);
    if (a.GetVersion(&a.version) != kNcclSuccess || a.version < 21800) {
      return unavailable_error("nccl: " + a.path + " is version " + std::to_string(a.version) +
                               "; combs needs 2.18 or later");
    }
    return &a;
  }();
  return api;
}

std::string version_text(int v) {  // 22807 -> "2.28.7"
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

// The group's communicators, one per rank. Aborting aborts every one of them at once, from
// whichever thread notices (NCCL allows ncclCommAbort from another thread: a rank blocked in a
// collective or a stream wait is freed); the group's end destroys them together (ncclCommDestroy
// is collective over a node's ranks: one thread calls it for all within a group call).
class NcclGroup {
 public:
  NcclGroup(const NcclApi& api, std::vector<ncclComm_t> comms) : api_(api), comms_(std::move(comms)) {}
  ~NcclGroup() {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) return;  // (ncclCommAbort freed them)
    api_.GroupStart();
    for (ncclComm_t c : comms_) api_.CommDestroy(c);
    api_.GroupEnd();
  }
  ncclComm_t comm(int rank) const { return comms_[static_cast<size_t>(rank)]; }
  bool aborted() const { return aborted_flag_.load(); }
  void abort() {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) return;
    aborted_ = true;
    aborted_flag_ = true;
    for (ncclComm_t c : comms_) api_.CommAbort(c);
  }

 private:
  const NcclApi& api_;
  std::vector<ncclComm_t> comms_;
  std::mutex mu_;
  bool aborted_ = false;  // guarded by mu_
  std::atomic<bool> aborted_flag_{false};
};

class NcclCollective final : public Collective {
 public:
  NcclCollective(const NcclApi& api, int rank, int world, int device, std::shared_ptr<NcclGroup> group)
      : api_(api), rank_(rank), world_(world), device_(device), group_(std::move(group)) {}
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  int device() const override { return device_; }
  bool capturable() const override { return true; }
  bool aborted() const override { return group_->aborted(); }
  std::string description() const override { return "nccl " + version_text(api_.version) + " (" + api_.path + ")"; }

  Status all_reduce_sum(float* data, int64_t n, void* stream) override {
    COMBS_RETURN_IF_ERROR(usable());
    const ncclResult_t r = api_.AllReduce(data, data, static_cast<size_t>(n), kNcclFloat32, kNcclSum,
                                          group_->comm(rank_), static_cast<cudaStream_t>(stream));
    return r == kNcclSuccess ? ok_status() : api_.error(r, "ncclAllReduce");
  }
  Status all_gather(const float* send, float* recv, int64_t n, void* stream) override {
    COMBS_RETURN_IF_ERROR(usable());
    const ncclResult_t r = api_.AllGather(send, recv, static_cast<size_t>(n), kNcclFloat32, group_->comm(rank_),
                                          static_cast<cudaStream_t>(stream));
    return r == kNcclSuccess ? ok_status() : api_.error(r, "ncclAllGather");
  }

  Status wait(void* stream, std::chrono::milliseconds deadline) override {
    const auto start = std::chrono::steady_clock::now();
    auto st = static_cast<cudaStream_t>(stream);
    for (int polls = 0;; ++polls) {
      const cudaError_t q = cudaStreamQuery(st);
      if (q == cudaSuccess) return ok_status();
      if (q != cudaErrorNotReady) {
        const Status failed = cuda::cuda_status(q, "cudaStreamQuery");
        return abort_with(failed.message());
      }
      if (group_->aborted()) return abort_with("a peer rank failed");
      ncclResult_t async = kNcclSuccess;
      if (api_.CommGetAsyncError(group_->comm(rank_), &async) == kNcclSuccess && async != kNcclSuccess &&
          async != kNcclInProgress) {
        return abort_with(std::string("NCCL reports ") + api_.GetErrorString(async));
      }
      const auto waited = std::chrono::steady_clock::now() - start;
      if (waited > deadline) return abort_with("the step did not finish in " + std::to_string(deadline.count()) + " ms");
      // Spin for the first 200 us (a decode step's tail), then back off.
      if (waited < std::chrono::microseconds(200)) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  void abort() override { group_->abort(); }

 private:
  Status usable() const {
    if (group_->aborted()) {
      return unavailable_error("nccl: rank " + std::to_string(rank_) + ": the group was aborted");
    }
    return ok_status();
  }
  Status abort_with(const std::string& why) {
    group_->abort();  // the collectives in flight on every rank end
    return unavailable_error("nccl: rank " + std::to_string(rank_) + " of " + std::to_string(world_) + ": " + why +
                             "; the group is aborted");
  }

  const NcclApi& api_;
  int rank_, world_, device_;
  std::shared_ptr<NcclGroup> group_;
};

}  // namespace

StatusOr<std::string> nccl_library_description() {
  COMBS_ASSIGN_OR_RETURN(const NcclApi* api, nccl_api());
  return "nccl " + version_text(api->version) + " (" + api->path + ")";
}

StatusOr<std::vector<std::unique_ptr<Collective>>> make_nccl_group(std::span<const int> devices) {
  if (devices.empty()) return invalid_argument_error("nccl: no devices");
  // NVLink multicast (NVLS) stays off unless the user set it: on these hosts it can take shared
  // GPUs out of service.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  COMBS_ASSIGN_OR_RETURN(const NcclApi* api, nccl_api());
  const int n = static_cast<int>(devices.size());
  int count = 0;
  COMBS_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  for (int d : devices) {
    if (d < 0 || d >= count) {
      return invalid_argument_error("nccl: device " + std::to_string(d) + " does not exist (" + std::to_string(count) +
                                    " CUDA devices)");
    }
  }
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  if (ncclResult_t r = api->CommInitAll(comms.data(), n, devices.data()); r != kNcclSuccess) {
    return api->error(r, "ncclCommInitAll");
  }
  auto group = std::make_shared<NcclGroup>(*api, comms);
  // A first all-reduce on every rank at once: NCCL connects the ranks now, not inside a forward.
  {
    std::vector<float*> buf(devices.size(), nullptr);
    Status warm = ok_status();
    for (int i = 0; i < n && warm.ok(); ++i) {
      warm = cuda::cuda_status(cudaSetDevice(devices[i]), "cudaSetDevice");
      if (warm.ok()) warm = cuda::cuda_status(cudaMalloc(&buf[i], 4), "cudaMalloc");
    }
    if (warm.ok()) {
      api->GroupStart();
      for (int i = 0; i < n; ++i) {
        cudaSetDevice(devices[i]);
        if (ncclResult_t r = api->AllReduce(buf[i], buf[i], 1, kNcclFloat32, kNcclSum, comms[i], nullptr);
            r != kNcclSuccess && warm.ok()) {
          warm = api->error(r, "ncclAllReduce (warm-up)");
        }
      }
      if (ncclResult_t r = api->GroupEnd(); r != kNcclSuccess && warm.ok()) warm = api->error(r, "ncclGroupEnd");
      for (int i = 0; i < n && warm.ok(); ++i) {
        cudaSetDevice(devices[i]);
        warm = cuda::cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize (warm-up)");
      }
    }
    for (int i = 0; i < n; ++i) {
      if (buf[i]) {
        cudaSetDevice(devices[i]);
        cudaFree(buf[i]);
      }
    }
    if (!warm.ok()) {
      group->abort();
      return warm;
    }
  }
  std::vector<std::unique_ptr<Collective>> out;
  for (int i = 0; i < n; ++i) out.push_back(std::make_unique<NcclCollective>(*api, i, n, devices[i], group));
  return out;
}

}  // namespace combs
