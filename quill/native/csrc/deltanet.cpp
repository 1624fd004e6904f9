// Python binding of the Gated DeltaNet decode update (deltanet.h): check the layer's weights,
// its state pools, the step's inputs and rows, take the ISA variant's functions (isa.h) and
// split both passes across torch's pool.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "deltanet_op.h"
#include "isa.h"
#include "ops.h"

namespace quill {
namespace {

// float32 [shape] with contiguous rows (any row stride when `rows_may_stride`)
void expect_f32(const at::Tensor& t, at::IntArrayRef shape, const char* name, const char* what,
                bool rows_may_stride = false) {
  const bool layout = t.dim() == 2 && rows_may_stride ? t.stride(1) == 1 : t.is_contiguous();
  if (t.scalar_type() != at::kFloat || t.sizes() != shape || !layout)
    op_fail(what, "'", name, "' should be ", rows_may_stride ? "" : "contiguous ", "float32 ", shape, ", found ",
            t.dtype(), " ", t.sizes(), layout ? "" : " (not contiguous)");
}

}  // namespace

DeltaNetArgs deltanet_layer(const at::Tensor& conv_w, const std::optional<at::Tensor>& conv_b,
                            const at::Tensor& a_log, const at::Tensor& dt_bias, const at::Tensor& norm_w, double eps,
                            const at::Tensor& conv_state, const at::Tensor& state, const char* what) {
  if (state.dim() != 4 || state.size(1) < 1 || state.size(2) < 1 || state.size(3) < 1)
    op_fail(what, "'state' should be float32 [N, Hv, dk, dv], found ", state.dtype(), " ", state.sizes());
  const int64_t n = state.size(0), hv = state.size(1), dk = state.size(2), dv = state.size(3);
  if (conv_w.dim() != 2 || conv_w.size(1) < 1)
    op_fail(what, "'conv_w' should be float32 [C, K] (conv1d.weight squeezed), found ", conv_w.dtype(), " ",
            conv_w.sizes());
  const int64_t c = conv_w.size(0), k = conv_w.size(1);
  const int64_t hk = (c - hv * dv) / (2 * dk);
  if (hk < 1 || 2 * hk * dk + hv * dv != c || hv % hk)
    op_fail(what, "'conv_w' has ", c, " channels; with 'state' [N, ", hv, ", ", dk, ", ", dv,
            "] expected 2 * Hk * ", dk, " + ", hv * dv, " for a number of key heads Hk dividing ", hv);
  expect_f32(conv_w, {c, k}, "conv_w", what);
  if (conv_b) expect_f32(*conv_b, {c}, "conv_b", what);
  expect_f32(a_log, {hv}, "A_log", what);
  expect_f32(dt_bias, {hv}, "dt_bias", what);
  expect_f32(norm_w, {dv}, "norm_w", what);
  expect_f32(conv_state, {n, c, k - 1}, "conv_state", what);
  expect_f32(state, {n, hv, dk, dv}, "state", what);
  DeltaNetArgs a;
  a.conv_w = conv_w.data_ptr<float>();
  a.conv_b = conv_b ? conv_b->data_ptr<float>() : nullptr;
  a.a_log = a_log.data_ptr<float>(), a.dt_bias = dt_bias.data_ptr<float>(), a.norm_w = norm_w.data_ptr<float>();
  a.eps = float(eps);
  a.conv_state = conv_state.data_ptr<float>(), a.state = state.data_ptr<float>();
  a.hk = hk, a.hv = hv, a.dk = dk, a.dv = dv, a.c = c, a.k = k;
  return a;
}

void deltanet_check_rows(const at::Tensor& rows, int64_t b, int64_t n, const char* what) {
  if (rows.scalar_type() != at::kLong || rows.sizes() != at::IntArrayRef({b}) || !rows.is_contiguous())
    op_fail(what, "'rows' should be contiguous int64 [", b, "], found ", rows.dtype(), " ", rows.sizes());
  const int64_t* r = rows.data_ptr<int64_t>();
  std::vector<int64_t> seen(r, r + b);
  for (int64_t i = 0; i < b; ++i)
    if (r[i] < 0 || r[i] >= n) op_fail(what, "sequence ", i, " names state row ", r[i], "; the pools have ", n);
  std::sort(seen.begin(), seen.end());
  if (std::adjacent_find(seen.begin(), seen.end()) != seen.end())
    op_fail(what, "two sequences name state row ", *std::adjacent_find(seen.begin(), seen.end()),
            " (each sequence owns its row)");
}

namespace {

// qkv [B, C], z [B, Hv dv], a and b [B, Hv] float32 (rows may be strided); the layer's weights
// (deltanet_layer); conv_state [N, C, K - 1] and state [N, Hv, dk, dv] updated in place at rows [B];
// tiled: value head h reads key head h % Hk (GGUF's order) -> [B, Hv dv], the gated-normed output
// out_proj reads.
at::Tensor deltanet_decode(const at::Tensor& qkv, const at::Tensor& z, const at::Tensor& a_in, const at::Tensor& b_in,
                           const at::Tensor& conv_w, const std::optional<at::Tensor>& conv_b, const at::Tensor& a_log,
                           const at::Tensor& dt_bias, const at::Tensor& norm_w, double eps, at::Tensor& conv_state,
                           at::Tensor& state, const at::Tensor& rows, const std::string& isa, bool tiled) {
  constexpr const char* what = "deltanet_decode";
  const IsaBackend& be = backend_for(isa, what);
  DeltaNetArgs a = deltanet_layer(conv_w, conv_b, a_log, dt_bias, norm_w, eps, conv_state, state, what);
  if (qkv.dim() != 2) op_fail(what, "'qkv' should be float32 [B, ", a.c, "], found ", qkv.dtype(), " ", qkv.sizes());
  const int64_t b = qkv.size(0);
  expect_f32(qkv, {b, a.c}, "qkv", what, true);
  expect_f32(z, {b, a.hv * a.dv}, "z", what, true);
  const at::Tensor av = a_in.contiguous(), bv = b_in.contiguous();
  expect_f32(av, {b, a.hv}, "a", what);
  expect_f32(bv, {b, a.hv}, "b", what);
  deltanet_check_rows(rows, b, state.size(0), what);
  at::Tensor out = at::empty({b, a.hv * a.dv}, qkv.options());
  at::Tensor x = at::empty({b, a.c}, qkv.options());
  a.qkv = qkv.data_ptr<float>(), a.ld_qkv = qkv.stride(0);
  a.z = z.data_ptr<float>(), a.ld_z = z.stride(0);
  a.a = av.data_ptr<float>(), a.b = bv.data_ptr<float>(), a.ld_ab = a.hv;
  a.rows = rows.data_ptr<int64_t>();
  a.x = x.data_ptr<float>(), a.out = out.data_ptr<float>(), a.ld_out = a.hv * a.dv;
  a.b_count = b;
  a.tiled = tiled;
  // Another thread pays off once the passes read more than ~256 KiB of state.
  const int64_t state_bytes = b * a.hv * a.dk * a.dv * 4;
  const int threads = at::in_parallel_region() || state_bytes < (256 << 10)
                          ? 1
                          : int(std::min<int64_t>(b * a.hv, at::get_num_threads()));
  auto pass = [&](bool heads) {  // every conv item is done before any head reads x
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> scratch(size_t(heads ? dnet_scratch(a.dk, a.dv) : 0));
      for (int64_t t = t0; t < t1; ++t) {
        if (heads) deltanet_head_share(a, be.dn_head, int(t), threads, scratch.data());
        else deltanet_conv_share(a, be.dn_conv, int(t), threads);
      }
    });
  };
  if (threads == 1) {
    std::vector<float> scratch(size_t(dnet_scratch(a.dk, a.dv)));
    deltanet_conv_share(a, be.dn_conv, 0, 1);
    deltanet_head_share(a, be.dn_head, 0, 1, scratch.data());
  } else {
    pass(false);
    pass(true);
  }
  return out;
}

}  // namespace

void register_deltanet(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("deltanet_decode", &deltanet_decode, py::arg("qkv"), py::arg("z"), py::arg("a"), py::arg("b"),
        py::arg("conv_w"), py::arg("conv_b"), py::arg("A_log"), py::arg("dt_bias"), py::arg("norm_w"),
        py::arg("eps"), py::arg("conv_state"), py::arg("state"), py::arg("rows"), py::arg("isa"),
        py::arg("tiled") = false, py::call_guard<py::gil_scoped_release>());
}

}  // namespace quill
