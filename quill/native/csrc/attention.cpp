// Python binding of decode attention (attention.h): checks shapes and strides, picks the
// ISA variant, splits the (sequence, KV head) pairs across torch's pool.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "attention.h"
#include "ops.h"

namespace quill {
namespace {

template <class... A>
[[noreturn]] void fail(const A&... parts) {
  std::ostringstream s;
  s << "decode_attention: ";
  (s << ... << parts);
  throw OpFailure(s.str());
}

AttnHead head_for(const std::string& isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  if (isa == "auto") return avx512 ? attn_head_avx512() : avx2 ? attn_head_avx2() : attn_head_scalar();
  if (isa == "scalar") return attn_head_scalar();
  if (isa == "avx2") {
    if (!avx2) fail("ISA 'avx2' needs AVX2 and FMA, which this CPU lacks");
    return attn_head_avx2();
  }
  if (isa == "avx512") {
    if (!avx512) fail("ISA 'avx512' needs AVX512F/BW/VL, which this CPU lacks");
    return attn_head_avx512();
  }
  fail("unknown ISA '", isa, "'; supported: auto, avx512, avx2, scalar");
}

// k or v as [B, Hkv, S, D] float32 with a contiguous last dimension (else a contiguous copy)
at::Tensor rows_view(const at::Tensor& t, const char* name, int64_t b, int64_t d) {
  if (t.scalar_type() != at::kFloat || t.dim() != 4 || t.size(0) != b || t.size(3) != d)
    fail("'", name, "' should be float32 [", b, ", Hkv, S, ", d, "], found ", t.dtype(), " ", t.sizes());
  return t.stride(3) == 1 ? t : t.contiguous();
}

}  // namespace

// q [B, H, 1, D], k and v [B, Hkv, S, D] float32, mask bool [B or 1, 1, 1, S] or None -> [B, H, 1, D]
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                            const std::optional<at::Tensor>& mask_in, double scale, const std::string& isa) {
  const AttnHead head = head_for(isa);
  if (q_in.scalar_type() != at::kFloat || q_in.dim() != 4 || q_in.size(2) != 1)
    fail("'q' should be float32 [B, H, 1, D], found ", q_in.dtype(), " ", q_in.sizes());
  const int64_t B = q_in.size(0), H = q_in.size(1), D = q_in.size(3);
  const at::Tensor k = rows_view(k_in, "k", B, D), v = rows_view(v_in, "v", B, D);
  const int64_t hkv = k.size(1), S = k.size(2);
  if (v.size(1) != hkv || v.size(2) != S) fail("'v' ", v.sizes(), " does not match 'k' ", k.sizes());
  if (hkv == 0 || H % hkv) fail(H, " query heads are not a multiple of ", hkv, " KV heads");
  const at::Tensor q = q_in.contiguous();  // [B, H, 1, D]
  at::Tensor mask;
  AttnArgs a;
  if (mask_in && mask_in->defined()) {
    const at::Tensor& m = *mask_in;
    if (m.scalar_type() != at::kBool || m.dim() != 4 || (m.size(0) != 1 && m.size(0) != B) || m.size(1) != 1 ||
        m.size(2) != 1 || m.size(3) != S)
      fail("'mask' should be bool [B or 1, 1, 1, ", S, "], found ", m.dtype(), " ", m.sizes());
    mask = m.reshape({m.size(0), S}).contiguous();  // [B or 1, S]
    a.mask = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
    a.mask_b = m.size(0) == 1 ? 0 : S;
  }
  at::Tensor out = at::empty({B, H, 1, D}, q.options());
  a.q = q.data_ptr<float>();
  a.k = k.data_ptr<float>();
  a.v = v.data_ptr<float>();
  a.out = out.data_ptr<float>();
  a.kb = k.stride(0), a.kh = k.stride(1), a.ks = k.stride(2);
  a.vb = v.stride(0), a.vh = v.stride(1), a.vs = v.stride(2);
  a.b = B, a.h = H, a.hkv = hkv, a.s = S, a.d = D;
  a.scale = float(scale);
  const int64_t pairs = B * hkv, scratch = (H / hkv) * (S + D);
  auto run = [&](int64_t p0, int64_t p1) {  // (sequence, KV head) pairs [p0, p1)
    std::vector<float> buf(scratch);
    for (int64_t p = p0; p < p1; ++p) head(a, p / hkv, p % hkv, buf.data());
  };
  // Another thread pays off once the pairs read more than ~256 KiB of K and V together.
  if (pairs < 2 || pairs * S * D * 8 < (256 << 10) || at::in_parallel_region())
    run(0, pairs);
  else
    at::parallel_for(0, pairs, 1, run);
  return out;
}

void register_attention(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("decode_attention", &decode_attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"),
        py::arg("scale"), py::arg("isa") = "auto", py::call_guard<py::gil_scoped_release>());
}

}  // namespace quill
