// CpuBackend::parallel_for: every index once, its writes visible to the caller, through back to
// back calls (the workers spinning), calls after the workers went to sleep, park_workers(), nested
// calls and several calling threads. Built into the engine's tests so that it also runs under
// ThreadSanitizer (the tsan preset runs those).
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "combs/backend/cpu/cpu_backend.h"

using namespace combs;

namespace {

// One call over n indices; each index writes its own slot (plain stores: the caller must see them
// after the call returns) and counts itself. Whether every index ran exactly once.
bool covers_once(CpuBackend& backend, int64_t n, int salt) {
  std::vector<int64_t> out(static_cast<size_t>(n), -1);
  std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
  backend.parallel_for(n, [&](int64_t i) {
    out[static_cast<size_t>(i)] = i * 3 + salt;
    hits[static_cast<size_t>(i)].fetch_add(1, std::memory_order_relaxed);
  });
  for (int64_t i = 0; i < n; ++i) {
    if (out[static_cast<size_t>(i)] != i * 3 + salt || hits[static_cast<size_t>(i)].load() != 1) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("cpu parallel_for runs every index once, back to back, after sleeping and after park",
          "[engine][pool]") {
  for (const int threads : {1, 2, 4}) {
    CAPTURE(threads);
    CpuBackend backend(CpuBackendOptions{threads});
    REQUIRE(backend.num_threads() == threads);
    int bad = 0;
    for (int call = 0; call < 300; ++call) {  // back to back: the workers never sleep between these
      const int64_t n = 1 + (call * 37) % 211;
      if (!covers_once(backend, n, call)) ++bad;
    }
    CHECK(bad == 0);
    for (int call = 0; call < 3; ++call) {  // the workers have gone to sleep before each of these
      std::this_thread::sleep_for(std::chrono::milliseconds(3));
      CHECK(covers_once(backend, 64, call));
    }
    for (int call = 0; call < 50; ++call) {  // parked between calls, as before a oneDNN product
      backend.park_workers();
      CHECK(covers_once(backend, 1 + call, call));
    }
    CHECK(covers_once(backend, 0, 0));
  }
}

TEST_CASE("cpu parallel_for inside parallel_for runs inline, and calls from several threads are served",
          "[engine][pool]") {
  CpuBackend backend(CpuBackendOptions{3});
  std::vector<std::atomic<int>> hits(16 * 16);
  backend.parallel_for(16, [&](int64_t i) {
    backend.parallel_for(16, [&](int64_t j) { hits[static_cast<size_t>(i * 16 + j)].fetch_add(1); });
  });
  int wrong = 0;
  for (auto& h : hits) wrong += h.load() != 1;
  CHECK(wrong == 0);

  std::atomic<int> failures{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&, c] {
      for (int call = 0; call < 100; ++call) {
        if (!covers_once(backend, 1 + (call * 13 + c) % 97, c * 1000 + call)) failures.fetch_add(1);
      }
    });
  }
  for (auto& t : callers) t.join();
  CHECK(failures.load() == 0);
}
