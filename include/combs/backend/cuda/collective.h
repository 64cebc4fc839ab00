// Collectives between the ranks of a tensor-parallel model (one rank per GPU, one thread per
// rank): the all-reduce after the attention's and the FFN's row-split projections, and the
// gather of the vocabulary-split logits. Every call is queued on the rank's stream (no host wait)
// and every rank must make the same calls in the same order.
//
// Two kinds:
// - NCCL (make_nccl_group): one communicator per GPU, made in one call for all ranks. combs does
//   not link NCCL: libnccl.so.2 is loaded at run time (COMBS_NCCL_LIBRARY, else the loader's
//   path, else the nvidia-nccl Python wheel's folder), so combs builds and runs everything else
//   where NCCL is absent, and make_nccl_group says UNAVAILABLE there. Its calls can be captured
//   into CUDA graphs.
// - In-process (make_local_group): ranks that share one GPU, the sums made by one kernel over
//   the ranks' buffers in rank order after a host barrier. It tests the split logic with two or
//   more ranks on a machine with one GPU (NCCL refuses two ranks on one device); it waits on the
//   host, so it cannot be captured.
// A rank whose peer fails or stops would wait forever in a collective: wait() polls the stream
// with a deadline and the communicator's own error, and aborts the group rather than hang; a rank
// that fails mid-step aborts it itself, which frees its peers at once.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "combs/base/status.h"

namespace combs {

class Collective {
 public:
  virtual ~Collective() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  // The GPU this rank runs on.
  virtual int device() const = 0;
  // In place: every rank's n floats become their sum over the ranks (the same bits on every rank).
  virtual Status all_reduce_sum(float* data, int64_t n, void* stream) = 0;
  // recv [world, n] on every rank: rank r's send (n floats) at row r.
  virtual Status all_gather(const float* send, float* recv, int64_t n, void* stream) = 0;
  // Whether the calls can be captured into a CUDA graph.
  virtual bool capturable() const = 0;
  // Waits for the stream's work; on a peer's failure or past the deadline the group is aborted
  // (every later call fails) and UNAVAILABLE names what happened.
  virtual Status wait(void* stream, std::chrono::milliseconds deadline) = 0;
  // Aborts the group, from any thread: the collectives in flight on every rank end with an
  // error, and every later call and wait() fails (UNAVAILABLE). For good: a group does not recover.
  virtual void abort() = 0;
  virtual bool aborted() const = 0;
  // "nccl 2.28.7" or "in-process".
  virtual std::string description() const = 0;
};

// One NCCL communicator per device in `devices` (rank i on devices[i]), made together: UNAVAILABLE
// where libnccl.so.2 cannot be loaded (naming where it looked), INTERNAL for NCCL's own errors.
StatusOr<std::vector<std::unique_ptr<Collective>>> make_nccl_group(std::span<const int> devices);

// `world` ranks on one device, in this process.
StatusOr<std::vector<std::unique_ptr<Collective>>> make_local_group(int world, int device);

// The NCCL library this process would load (or did): its path and version, or why not.
StatusOr<std::string> nccl_library_description();

}  // namespace combs
