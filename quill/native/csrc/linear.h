// What the quantized linear's binding (linear.cpp) and the module's free functions (binding.cpp)
// share: the precondition error, tensor checks, and the kernel table of an ISA name.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "isa.h"

namespace quill {

struct KernelFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <class... A>
[[noreturn]] void fail(const A&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  throw KernelFailure(s.str());
}

inline std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.dtype() << " " << t.sizes();
  return s.str();
}

inline void expect(const at::Tensor& t, at::ScalarType dt, std::vector<int64_t> shape, const char* what) {
  if (t.scalar_type() != dt || t.sizes() != at::IntArrayRef(shape) || !t.is_contiguous() || t.device().is_cuda())
    fail("native kernel: tensor '", what, "' should be contiguous ", c10::toString(dt), " ", at::IntArrayRef(shape),
         ", found ", shape_of(t));
}

inline DType dtype_of(at::ScalarType t, const char* what) {
  switch (t) {
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    default: fail("native kernel: '", what, "' has dtype ", c10::toString(t), "; supported: float32, float16, bfloat16");
  }
}

// The quantized linear's kernel table of an ISA (the backend table, isa.h, checks the name).
inline const KernelTable& table_for(const std::string& isa) { return *backend_for(isa, "native kernel").linear; }

void register_linear(pybind11::module_& m);  // linear.cpp: LinearOp, NativeLinear

}  // namespace quill
