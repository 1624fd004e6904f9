// KV pools as torch tensors, shared by the attention bindings and the native step: [N, Hkv, D]
// float32, bfloat16 or float16 (a 16-bit KV cache), k and v alike.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "attention.h"

namespace quill {

KVType pool_type(const at::Tensor& pool);  // (of a pool pools_problem accepted)
// "" when k and v are contiguous [N, Hkv, d] pools of one supported type and shape, else what is wrong
std::string pools_problem(const at::Tensor& k, const at::Tensor& v, int64_t d);

// a.k / a.v (float32 pools) or a.k16 / a.v16 and a.f16 (16-bit pools): AttnArgs or PrefillArgs
template <class Args>
void set_pools(Args& a, const at::Tensor& k, const at::Tensor& v) {
  const KVType t = pool_type(k);
  if (t == KVType::F32) {
    a.k = k.data_ptr<float>(), a.v = v.data_ptr<float>();
    return;
  }
  a.k16 = static_cast<const uint16_t*>(k.data_ptr()), a.v16 = static_cast<const uint16_t*>(v.data_ptr());
  a.f16 = t == KVType::F16;
}

}  // namespace quill
