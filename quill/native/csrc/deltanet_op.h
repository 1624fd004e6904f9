// The torch side of the Gated DeltaNet decode update (deltanet.h): one layer's weights and state
// pools checked and described once (deltanet.cpp), shared by the Python op and the decode step.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "deltanet.h"

namespace quill {

// A layer's weights and per-sequence state pools, checked (OpFailure naming `what`, the tensor,
// the shape found and the one expected), with its sizes derived from them:
//   conv_w [C, K], conv_b [C] or None, a_log [Hv], dt_bias [Hv], norm_w [dv], all float32;
//   conv_state [N, C, K - 1], state [N, Hv, dk, dv], float32 contiguous; C = 2 Hk dk + Hv dv.
// The step's inputs, rows and outputs are left for the caller.  The tensors are borrowed.
DeltaNetArgs deltanet_layer(const at::Tensor& conv_w, const std::optional<at::Tensor>& conv_b,
                            const at::Tensor& a_log, const at::Tensor& dt_bias, const at::Tensor& norm_w, double eps,
                            const at::Tensor& conv_state, const at::Tensor& state, const char* what);

// rows int64 [B], each in [0, N) and no two alike (two sequences on one state row would race).
void deltanet_check_rows(const at::Tensor& rows, int64_t b, int64_t n, const char* what);

// Thread `tid` of `nt`'s share of each pass: (sequence, channel chunk) items of the conv pass, and
// (sequence, value head) items of the head pass, which reads every conv item's output (a barrier
// between them).  scratch: dnet_scratch(dk, dv) floats of this thread.
inline void deltanet_conv_share(const DeltaNetArgs& a, DnConv conv, int tid, int nt) {
  constexpr int64_t kChunk = 512;  // channels per item
  const int64_t chunks = (a.c + kChunk - 1) / kChunk, items = a.b_count * chunks;
  for (int64_t it = items * tid / nt; it < items * (tid + 1) / nt; ++it) {
    const int64_t c0 = (it % chunks) * kChunk;
    conv(a, it / chunks, c0, std::min(a.c, c0 + kChunk));
  }
}
inline void deltanet_head_share(const DeltaNetArgs& a, DnHead head, int tid, int nt, float* scratch) {
  const int64_t items = a.b_count * a.hv;
  for (int64_t it = items * tid / nt; it < items * (tid + 1) / nt; ++it) head(a, it / a.hv, it % a.hv, scratch);
}

}  // namespace quill
