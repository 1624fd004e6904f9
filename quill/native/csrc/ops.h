// Fused element-wise ops (ops.cpp), registered on the extension module by binding.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>

namespace quill {

// A precondition of a fused op failed (raised in Python as quill.errors.KernelError).
struct OpFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Throw an OpFailure whose message is `what: ` followed by the parts.
template <class... A>
[[noreturn]] void op_fail(const char* what, const A&... parts) {
  std::ostringstream s;
  s << what << ": ";
  (s << ... << parts);
  throw OpFailure(s.str());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);  // [..., D] -> [..., D]
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);        // in place, [B, T, H, D]
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);               // same shape
at::Tensor gelu_tanh_mul(const at::Tensor& gate, const at::Tensor& up);          // same shape (Gemma)
at::Tensor sigmoid(const at::Tensor& x);                                          // same shape
// The same ops' float32 row ranges, for callers that split the rows themselves (step.cpp); the
// bits of the tensor versions.  rms_norm_f32 may work in place (y == x).
void rms_norm_f32(const float* x, const float* w, float* y, int64_t d, float eps, int64_t r0, int64_t r1);  // [R, d]
void rope_f32(float* x, const float* cos, const float* sin, int64_t heads, int64_t d, int64_t t0,
              int64_t t1);                                                          // x [T, heads, d], cos [T, d]
// the first d channels of heads ld apart rotated (partial rotary: ld = head_dim > d = rotary dim)
void rope_f32(float* x, const float* cos, const float* sin, int64_t heads, int64_t d, int64_t ld, int64_t t0,
              int64_t t1);                                                          // x [T, heads, ld], cos [T, d]
void sigmoid_f32(const float* x, float* y, int64_t i0, int64_t i1);                 // elements [i0, i1)
void silu_mul_f32(const float* g, const float* u, float* y, int64_t i0, int64_t i1);  // elements [i0, i1)
void gelu_tanh_mul_f32(const float* g, const float* u, float* y, int64_t i0, int64_t i1);  // elements [i0, i1)
// gpt-oss: (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha g'), g' = min(g, limit); elements [i0, i1)
void swiglu_clamped_f32(const float* g, const float* u, float* y, float alpha, float limit, int64_t i0, int64_t i1);
// attention.cpp: q [B, H, 1, D] float32 through a paged pool's slot tables [B, S] -> [B, H, 1, D]
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& slots, const at::Tensor& lens, double scale, const std::string& isa,
                                  int64_t window = 0, const std::optional<at::Tensor>& sinks = std::nullopt);

void register_ops(pybind11::module_& m);
void register_dense(pybind11::module_& m);      // dense.cpp: NativeDense
void register_attention(pybind11::module_& m);  // attention.cpp: decode_attention
void register_step(pybind11::module_& m);       // step.cpp: DecoderStep
void register_moe(pybind11::module_& m);        // moe.cpp: ExpertGroup

}  // namespace quill
