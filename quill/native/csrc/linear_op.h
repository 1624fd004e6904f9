// What a fused decode step (step.cpp) calls on a layer's linear: the quantized NativeLinear
// (binding.cpp) and the dense NativeDense (dense.cpp) both implement it, so the step holds
// either without knowing which.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace quill {

struct LinearOp {
  virtual ~LinearOp() = default;
  // x [..., K] -> y [..., N] (+ bias [N]); the same call as the Python binding's forward
  virtual at::Tensor run(const at::Tensor& x, const std::optional<at::Tensor>& bias) = 0;

  // The same call split across a team of threads that is already running (step.cpp), in two
  // phases with a barrier between them: every thread calls team_prepare (tokens split; a single token's
  // segments where they are independent: float image, int8 per segment), then,
  // after the barrier, team_gemm (row blocks split) with the same x.  x float32 [M, K] and y float32 [M, N]
  // contiguous (y's rows `ldy` floats apart); bias float32 [N] or null; scratch: team_scratch(M) bytes shared by the team,
  // 64-byte aligned.  The result is run()'s bits.
  virtual int64_t in_features() const = 0;
  virtual int64_t out_features() const = 0;
  virtual int64_t threads() const = 0;
  // bytes of scratch for M tokens, or -1 when one call cannot take M tokens at once (use run)
  virtual int64_t team_scratch(int64_t m) const = 0;
  virtual void team_prepare(const float* x, int64_t m, void* scratch, int tid, int nt) const = 0;
  virtual void team_gemm(const float* x, const void* scratch, int64_t m, float* y, int64_t ldy, const float* bias,
                         int tid, int nt) const = 0;
};

// [begin, end) of `count` items for thread `tid` of `nt`
inline void team_share(int64_t count, int tid, int nt, int64_t& begin, int64_t& end) {
  begin = count * tid / nt;
  end = count * (tid + 1) / nt;
}

inline int64_t align64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

}  // namespace quill
