// Splitting a call's row blocks across PyTorch's own intra-op pool (at::parallel_for), shared
// by the quantized (binding.cpp) and dense (dense.cpp) linears; torch TUs only.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace quill {

// Waking torch's OpenMP workers costs ~10 us here (libgomp puts them to sleep almost at
// once on this 2-CPU VM), as long as one thread streams ~280 KB; below that a second
// thread does not pay for itself.  (OMP_WAIT_POLICY=ACTIVE removes the wake-up, for
// torch's ops as well.)
constexpr int64_t kMinBytesPerThread = 256 << 10;

// Threads for `work` bytes of weight traffic: never more than torch's pool, the layer's
// setting, one per 256 KiB, or `parts` (the row blocks).
inline int threads_for(int layer_threads, int64_t work, int64_t parts) {
  const int64_t t = std::min<int64_t>(
      {int64_t(layer_threads), int64_t(at::get_num_threads()), std::max<int64_t>(1, work / kMinBytesPerThread), parts});
  return int(std::max<int64_t>(1, t));
}

// body(begin, end) over [0, count) cut into `parts` contiguous pieces, one per thread.
template <class F>
void parallel_parts(int parts, int64_t count, const F& body) {
  if (parts <= 1 || at::in_parallel_region()) return body(0, count);
  at::parallel_for(0, parts, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) body(count * i / parts, count * (i + 1) / parts);
  });
}

}  // namespace quill
