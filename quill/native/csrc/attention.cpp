// Python bindings of decode attention (attention.h), over dense [B, Hkv, S, D] rows or through
// a paged pool's slot tables, and of prefill attention (prefill.h) through a slot table: check
// shapes, strides and tables, take the ISA variant's function (isa.h), split the work across torch's pool.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "attention.h"
#include "isa.h"
#include "kv_pool.h"
#include "ops.h"
#include "prefill.h"

namespace quill {
namespace {

template <class... A>
[[noreturn]] void attention_fail(const A&... parts) {
  op_fail("decode_attention", parts...);
}


// k or v as [B, Hkv, S, D] float32 with a contiguous last dimension (else a contiguous copy)
at::Tensor rows_view(const at::Tensor& t, const char* name, int64_t b, int64_t d) {
  if (t.scalar_type() != at::kFloat || t.dim() != 4 || t.size(0) != b || t.size(3) != d)
    attention_fail("'", name, "' should be float32 [", b, ", Hkv, S, ", d, "], found ", t.dtype(), " ", t.sizes());
  return t.stride(3) == 1 ? t : t.contiguous();
}

// Splits the (sequence, KV head) pairs of a.b x a.hkv across torch's pool.
void launch(const AttnArgs& a, AttnHead head) {
  const int64_t hkv = a.hkv, pairs = a.b * hkv, scratch = (a.h / hkv) * (a.s + a.d + (a.sinks ? 1 : 0));
  auto run = [&](int64_t p0, int64_t p1) {  // (sequence, KV head) pairs [p0, p1)
    std::vector<float> buf(scratch);
    for (int64_t p = p0; p < p1; ++p) head(a, p / hkv, p % hkv, buf.data());
  };
  // Another thread pays off once the pairs read more than ~256 KiB of K and V together.
  if (pairs < 2 || pairs * a.s * a.d * 8 < (256 << 10) || at::in_parallel_region())
    run(0, pairs);
  else
    at::parallel_for(0, pairs, 1, run);
}

// sinks: float32 [H] (one logit per query head), or None / an empty tensor (no sinks) -> its data or null
const float* sinks_of(const std::optional<at::Tensor>& sinks, int64_t h, const char* op, at::Tensor& keep) {
  if (!sinks || !sinks->defined() || sinks->numel() == 0) return nullptr;
  if (sinks->scalar_type() != at::kFloat || sinks->dim() != 1 || sinks->size(0) != h)
    op_fail(op, "'sinks' should be float32 [", h, "] (one per query head), found ", sinks->dtype(), " ",
            sinks->sizes());
  keep = sinks->contiguous();
  return keep.data_ptr<float>();
}

}  // namespace

KVType pool_type(const at::Tensor& pool) {
  switch (pool.scalar_type()) {
    case at::kBFloat16: return KVType::BF16;
    case at::kHalf: return KVType::F16;
    default: return KVType::F32;
  }
}

std::string pools_problem(const at::Tensor& k, const at::Tensor& v, int64_t d) {
  std::ostringstream os;
  for (const auto& [t, name] : {std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    const auto st = t->scalar_type();
    if ((st != at::kFloat && st != at::kBFloat16 && st != at::kHalf) || t->dim() != 3 || t->size(2) != d ||
        !t->is_contiguous()) {
      os << "'" << name << "' pool should be contiguous float32, bfloat16 or float16 [N, Hkv, " << d << "], found "
         << t->dtype() << " " << t->sizes();
      return os.str();
    }
  }
  if (v.sizes() != k.sizes() || v.scalar_type() != k.scalar_type())
    os << "'v' pool " << v.dtype() << " " << v.sizes() << " does not match 'k' pool " << k.dtype() << " " << k.sizes();
  return os.str();
}

// q [B, H, 1, D], k and v [B, Hkv, S, D] float32, mask bool [B or 1, 1, 1, S] or None -> [B, H, 1, D]
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                            const std::optional<at::Tensor>& mask_in, double scale, const std::string& isa,
                            const std::optional<at::Tensor>& sinks) {
  const AttnHead head = backend_for(isa, "decode_attention").attn_head;
  if (q_in.scalar_type() != at::kFloat || q_in.dim() != 4 || q_in.size(2) != 1)
    attention_fail("'q' should be float32 [B, H, 1, D], found ", q_in.dtype(), " ", q_in.sizes());
  const int64_t B = q_in.size(0), H = q_in.size(1), D = q_in.size(3);
  const at::Tensor k = rows_view(k_in, "k", B, D), v = rows_view(v_in, "v", B, D);
  const int64_t hkv = k.size(1), S = k.size(2);
  if (v.size(1) != hkv || v.size(2) != S) attention_fail("'v' ", v.sizes(), " does not match 'k' ", k.sizes());
  if (hkv == 0 || H % hkv) attention_fail(H, " query heads are not a multiple of ", hkv, " KV heads");
  const at::Tensor q = q_in.contiguous();  // [B, H, 1, D]
  at::Tensor mask;
  AttnArgs a;
  if (mask_in && mask_in->defined()) {
    const at::Tensor& m = *mask_in;
    if (m.scalar_type() != at::kBool || m.dim() != 4 || (m.size(0) != 1 && m.size(0) != B) || m.size(1) != 1 ||
        m.size(2) != 1 || m.size(3) != S)
      attention_fail("'mask' should be bool [B or 1, 1, 1, ", S, "], found ", m.dtype(), " ", m.sizes());
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
  at::Tensor sinks_kept;
  a.sinks = sinks_of(sinks, H, "decode_attention", sinks_kept);
  launch(a, head);
  return out;
}

// q [B, H, 1, D] float32; k and v pools [N, Hkv, D] float32 or bfloat16; slots int64 [B, Smax] (pool rows of each
// sequence's context, in order); lens int64 [B] (1 <= lens[b] <= Smax); window: attend the last `window`
// positions only (0: all) -> [B, H, 1, D]
at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& slots_in, const at::Tensor& lens_in, double scale,
                                  const std::string& isa, int64_t window, const std::optional<at::Tensor>& sinks) {
  const AttnHead head = backend_for(isa, "decode_attention").attn_head;
  if (q_in.scalar_type() != at::kFloat || q_in.dim() != 4 || q_in.size(2) != 1)
    attention_fail("'q' should be float32 [B, H, 1, D], found ", q_in.dtype(), " ", q_in.sizes());
  const int64_t B = q_in.size(0), H = q_in.size(1), D = q_in.size(3);
  if (const std::string problem = pools_problem(k, v, D); !problem.empty()) attention_fail(problem);
  const int64_t N = k.size(0), hkv = k.size(1);
  if (hkv == 0 || H % hkv) attention_fail(H, " query heads are not a multiple of ", hkv, " KV heads");
  if (slots_in.scalar_type() != at::kLong || slots_in.dim() != 2 || slots_in.size(0) != B)
    attention_fail("'slots' should be int64 [", B, ", S], found ", slots_in.dtype(), " ", slots_in.sizes());
  if (lens_in.scalar_type() != at::kLong || lens_in.dim() != 1 || lens_in.size(0) != B)
    attention_fail("'lens' should be int64 [", B, "], found ", lens_in.dtype(), " ", lens_in.sizes());
  const at::Tensor slots = slots_in.contiguous(), lens = lens_in.contiguous(), q = q_in.contiguous();
  const int64_t S = slots.size(1);
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // a bad table would read outside the pool: refuse it here
    if (ln[b] < 1 || ln[b] > S) attention_fail("sequence ", b, " has length ", ln[b], "; expected 1..", S);
    for (int64_t s = 0; s < ln[b]; ++s)
      if (sl[b * S + s] < 0 || sl[b * S + s] >= N)
        attention_fail("sequence ", b, " position ", s, " names pool row ", sl[b * S + s], "; the pool has ", N);
  }
  at::Tensor out = at::empty({B, H, 1, D}, q.options());
  AttnArgs a;
  a.q = q.data_ptr<float>();
  set_pools(a, k, v);
  a.out = out.data_ptr<float>();
  a.kh = a.vh = D, a.ks = a.vs = hkv * D;
  a.slots = sl, a.lens = ln, a.slot_b = S, a.window = window;
  a.b = B, a.h = H, a.hkv = hkv, a.s = S, a.d = D;
  a.scale = float(scale);
  at::Tensor sinks_kept;
  a.sinks = sinks_of(sinks, H, "decode_attention", sinks_kept);
  launch(a, head);
  return out;
}

// q [n, H, D] float32 (the chunk's queries); k and v pools [N, Hkv, D] float32; ctx int64 [S], S >= n (pool rows
// of the context, the chunk's tokens its last n) -> [n, H, D]: token i attends positions 0 .. S - n + i
// (window > 0: only the last `window` of them)
at::Tensor paged_prefill_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& ctx_in, double scale, const std::string& isa, int64_t window,
                                   const std::optional<at::Tensor>& sinks) {
  const PrefillBlock block = backend_for(isa, "prefill_attention").prefill;
  auto bad = [](const auto&... parts) { op_fail("prefill_attention", parts...); };
  if (q_in.scalar_type() != at::kFloat || q_in.dim() != 3 || q_in.size(0) < 1)
    bad("'q' should be float32 [n, H, D], n >= 1, found ", q_in.dtype(), " ", q_in.sizes());
  const int64_t n = q_in.size(0), H = q_in.size(1), D = q_in.size(2);
  if (const std::string problem = pools_problem(k, v, D); !problem.empty()) bad(problem);
  const int64_t N = k.size(0), hkv = k.size(1);
  if (hkv == 0 || H % hkv) bad(H, " query heads are not a multiple of ", hkv, " KV heads");
  if (ctx_in.scalar_type() != at::kLong || ctx_in.dim() != 1 || ctx_in.size(0) < n)
    bad("'ctx' should be int64 [S], S >= ", n, " (the chunk's tokens), found ", ctx_in.dtype(), " ", ctx_in.sizes());
  const at::Tensor ctx = ctx_in.contiguous(), q = q_in.contiguous();
  const int64_t S = ctx.size(0);
  const int64_t* cp = ctx.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)  // a bad table would read outside the pool: refuse it here
    if (cp[s] < 0 || cp[s] >= N) bad("position ", s, " names pool row ", cp[s], "; the pool has ", N);
  at::Tensor out = at::empty({n, H, D}, q.options());
  PrefillArgs a;
  a.q = q.data_ptr<float>(), a.ctx = cp;
  set_pools(a, k, v);
  a.out = out.data_ptr<float>();
  a.n = n, a.start = S - n, a.h = H, a.hkv = hkv, a.d = D, a.scale = float(scale), a.window = window;
  at::Tensor sinks_kept;
  a.sinks = sinks_of(sinks, H, "prefill_attention", sinks_kept);
  // (KV head, query block) items, the last blocks (the most keys) first, taken one at a time
  const int64_t tb = prefill_tokens_per_block(H / hkv), nb = (n + tb - 1) / tb, items = hkv * nb;
  const int64_t scratch = prefill_scratch(H / hkv, D, tb);
  const int threads = at::in_parallel_region() ? 1 : int(std::min<int64_t>(items, at::get_num_threads()));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> buf(static_cast<size_t>(scratch));
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t b = nb - 1 - it / hkv, h = it % hkv;
      block(a, h, b * tb, std::min(n, (b + 1) * tb), buf.data());
    }
  }
  return out;
}

// pool [n, w] float32 / bfloat16 / float16 (contiguous) = src [n, w] float32 as the decode step stores k / v rows
void store_kv_rows(const at::Tensor& src, at::Tensor& pool, const std::string& isa) {
  const KVStore store = backend_for(isa, "store_kv").kv_store;
  auto store_fail = [](const auto&... parts) { op_fail("store_kv", parts...); };
  if (src.scalar_type() != at::kFloat || src.dim() != 2 || !src.is_contiguous())
    store_fail("'src' should be contiguous float32 [n, w], found ", src.dtype(), " ", src.sizes());
  const auto st = pool.scalar_type();
  if ((st != at::kFloat && st != at::kBFloat16 && st != at::kHalf) || pool.sizes() != src.sizes() ||
      !pool.is_contiguous())
    store_fail("'pool' should be contiguous float32, bfloat16 or float16 ", src.sizes(), ", found ", pool.dtype(), " ",
               pool.sizes());
  const int64_t n = src.size(0), w = src.size(1);
  char* dst = static_cast<char*>(pool.data_ptr());
  for (int64_t r = 0; r < n; ++r) store(dst + r * w * pool.element_size(), src.data_ptr<float>() + r * w, w, pool_type(pool));
}

void register_attention(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("decode_attention", &decode_attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"),
        py::arg("scale"), py::arg("isa"), py::arg("sinks") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("k_pool"), py::arg("v_pool"),
        py::arg("slots"), py::arg("lens"), py::arg("scale"), py::arg("isa"), py::arg("window") = 0,
        py::arg("sinks") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("store_kv", &store_kv_rows, py::arg("src"), py::arg("pool"), py::arg("isa"));
  m.def("paged_prefill_attention", &paged_prefill_attention, py::arg("q"), py::arg("k_pool"), py::arg("v_pool"),
        py::arg("ctx"), py::arg("scale"), py::arg("isa"), py::arg("window") = 0, py::arg("sinks") = py::none(),
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace quill
