// What a fused decode step (step.cpp) calls on a layer's linear: the quantized NativeLinear
// (binding.cpp) and the dense NativeDense (dense.cpp) both implement it, so the step holds
// either without knowing which.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace quill {

struct LinearOp {
  virtual ~LinearOp() = default;
  // x [..., K] -> y [..., N] (+ bias [N]); the same call as the Python binding's forward
  virtual at::Tensor run(const at::Tensor& x, const std::optional<at::Tensor>& bias) = 0;
};

}  // namespace quill
