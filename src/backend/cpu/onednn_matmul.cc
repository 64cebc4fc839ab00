#include "onednn_matmul.h"

#if defined(COMBS_HAVE_ONEDNN)
#include <omp.h>

#include <dnnl.hpp>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>
#endif

namespace combs::cpu::onednn {

#if defined(COMBS_HAVE_ONEDNN)
namespace {

struct State {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  // Primitives by (m, n, k): creating one costs far more than running it.
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::pair<dnnl::matmul, size_t>> cache;
  std::vector<char> scratchpad;  // ours, reused: oneDNN's own would be allocated (and faulted in) per call
  std::mutex mu;
};

State* state() {
  static State* s = [] () -> State* {
    try {
      return new State();
    } catch (...) {
      return nullptr;
    }
  }();
  return s;
}

}  // namespace

bool available() {
  static const bool ok = [] {
    if (!state()) return false;
    try {  // ask for a BF16 matmul and check that the chosen implementation is native
      using dt = dnnl::memory::data_type;
      using tag = dnnl::memory::format_tag;
      const dnnl::memory::desc a({16, 64}, dt::bf16, tag::ab), b({64, 64}, dt::bf16, tag::ba),
          c({16, 64}, dt::f32, tag::ab);
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), state()->engine);
      const std::string impl = pd.impl_info_str();
      return impl.find("bf16") != std::string::npos || impl.find("amx") != std::string::npos;
    } catch (...) {
      return false;
    }
  }();
  return ok;
}

bool matmul_bf16(const uint16_t* x_bf16, const uint16_t* w, float* y, int64_t m, int64_t n_out,
                 int64_t k, int threads) {
  if (!available()) return false;
  State& s = *state();
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  const dnnl::memory::desc a_md({m, k}, dt::bf16, tag::ab), b_md({k, n_out}, dt::bf16, tag::ba),
      c_md({m, n_out}, dt::f32, tag::ab);
  try {
    std::lock_guard<std::mutex> lock(s.mu);
    auto key = std::make_tuple(m, n_out, k);
    auto it = s.cache.find(key);
    if (it == s.cache.end()) {
      if (s.cache.size() > 256) s.cache.clear();  // prompt lengths vary: keep it bounded
      dnnl::primitive_attr attr;
      attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), attr, s.engine);
      it = s.cache.emplace(key, std::make_pair(dnnl::matmul(pd), pd.scratchpad_desc().get_size())).first;
    }
    omp_set_num_threads(threads);
    const size_t pad_bytes = it->second.second;
    if (s.scratchpad.size() < pad_bytes) s.scratchpad.resize(pad_bytes);
    dnnl::memory a(a_md, s.engine, const_cast<uint16_t*>(x_bf16));
    dnnl::memory b(b_md, s.engine, const_cast<uint16_t*>(w));
    dnnl::memory c(c_md, s.engine, y);
    dnnl::memory pad(dnnl::memory::desc({static_cast<int64_t>(pad_bytes)}, dt::u8, tag::a), s.engine,
                     s.scratchpad.data());
    it->second.first.execute(s.stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c},
                                        {DNNL_ARG_SCRATCHPAD, pad}});
    s.stream.wait();
    return true;
  } catch (...) {
    return false;
  }
}
#else
bool available() { return false; }
bool matmul_bf16(const uint16_t*, const uint16_t*, float*, int64_t, int64_t, int64_t, int) {
  return false;
}
#endif

}  // namespace combs::cpu::onednn
