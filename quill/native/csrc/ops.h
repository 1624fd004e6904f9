// Fused element-wise ops (ops.cpp), registered on the extension module by binding.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <stdexcept>

namespace quill {

// A precondition of a fused op failed (raised in Python as quill.errors.KernelError).
struct OpFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);  // [..., D] -> [..., D]
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);        // in place, [B, T, H, D]
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);               // same shape

void register_ops(pybind11::module_& m);
void register_dense(pybind11::module_& m);      // dense.cpp: NativeDense
void register_attention(pybind11::module_& m);  // attention.cpp: decode_attention

}  // namespace quill
