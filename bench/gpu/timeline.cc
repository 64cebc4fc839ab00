// A kernel timeline of any CUDA program, kernels inside CUDA graphs included, without changing it:
// a CUPTI activity tracer loaded by the CUDA driver as an injection library. Not part of the
// build (the GPU machine has no Nsight Systems; this is the part of it we need).
//
//   g++ -O2 -shared -fPIC -I/usr/local/cuda/include bench/gpu/timeline.cc -o libtimeline.so \
//       -L/usr/local/cuda/lib64 -lcupti
//   CUDA_INJECTION64_PATH=$PWD/libtimeline.so COMBS_TIMELINE=/tmp/t.csv combs-bench gpu ...
//   python3 bench/gpu/timeline.py /tmp/t.csv
//
// Writes one CSV line per kernel: start and end (ns, the GPU's clock), graph id, grid, block,
// registers per thread, name (mangled). With programmatic dependent launch a kernel's start is
// when its first block began (waiting included); its end is when its last block finished.
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

FILE* out = nullptr;
constexpr size_t kBufferBytes = 16 << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && record->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    if (out) {
      std::fprintf(out, "%llu,%llu,%u,%d,%d,%d,%d,%u,%s\n", static_cast<unsigned long long>(k->start),
                   static_cast<unsigned long long>(k->end), k->graphId, k->gridX, k->gridY, k->gridZ, k->blockX,
                   static_cast<unsigned>(k->registersPerThread), k->name ? k->name : "?");
    }
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
  if (dropped) std::fprintf(stderr, "timeline: %zu records dropped\n", dropped);
  std::free(buffer);
}

void finish() {
  cuptiActivityFlushAll(1);
  if (out) std::fclose(out), out = nullptr;
}

}  // namespace

extern "C" int InitializeInjection(void) {
  const char* path = std::getenv("COMBS_TIMELINE");
  out = std::fopen(path ? path : "timeline.csv", "w");
  if (!out) return 0;
  std::fprintf(out, "start,end,graph,gx,gy,gz,bx,regs,name\n");
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
    std::fprintf(stderr, "timeline: CUPTI activity tracing unavailable\n");
    return 0;
  }
  std::atexit(finish);
  return 1;
}
