// Python binding of the dense 16-bit linear (dense.h): NativeDense holds one layer's packed
// words and the chosen ISA variant; forward(x, bias) is the whole per-call path.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "dense.h"
#include "isa.h"
#include "linear_op.h"
#include "ops.h"
#include "parallel.h"

namespace quill {
namespace {

template <class... A>
[[noreturn]] void dense_fail(const A&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  throw OpFailure(s.str());
}

class NativeDense final : public LinearOp {
 public:
  // words: int16 [NB, KP, 16, 2] (dense.h), the bit patterns of `dtype` ("bfloat16" or "float16")
  NativeDense(at::Tensor words, int64_t n, int64_t k, std::string dtype, std::string isa, int64_t threads)
      : words_(std::move(words)), isa_(isa), gemm_(backend_for(isa, "native dense").dense) {
    if (dtype != "bfloat16" && dtype != "float16")
      dense_fail("native dense: weight dtype '", dtype, "' is not supported; supported: bfloat16, float16");
    const int64_t nb = (n + LANES - 1) / LANES, kp = (k + 1) / 2;
    if (n <= 0 || k <= 0 || words_.scalar_type() != at::kShort || !words_.is_contiguous() ||
        words_.sizes() != at::IntArrayRef({nb, kp, LANES, 2}))
      dense_fail("native dense: words should be contiguous int16 [", nb, ", ", kp, ", 16, 2] for a [", n, ", ", k,
           "] weight, found ", words_.dtype(), " ", words_.sizes());
    w_.words = reinterpret_cast<const uint16_t*>(words_.data_ptr<int16_t>());
    w_.kp = kp;
    w_.n = int32_t(n);
    w_.nb = int32_t(nb);
    w_.f16 = dtype == "float16";
    k_ = k;
    set_threads(threads);
  }

  void set_threads(int64_t t) {
    if (t < 1) dense_fail("native dense: threads must be at least 1, found ", t);
    threads_ = int(t);
  }
  int64_t threads() const override { return threads_; }
  std::string isa() const { return isa_; }
  int64_t in_features() const override { return k_; }
  int64_t out_features() const override { return w_.n; }

  at::Tensor run(const at::Tensor& x, const std::optional<at::Tensor>& bias) override { return forward(x, bias); }

  // The team call (linear_op.h).  Scratch: x as float32 [M, 2 * KP] when K is odd (the last pair
  // padded with 0, as forward pads it), else none.
  int64_t team_scratch(int64_t m) const override {
    if (m > MAX_BLOCK_TOKENS) return -1;
    return 2 * w_.kp == k_ ? 0 : align64(m * 2 * w_.kp * 4);
  }

  void team_prepare(const float* x, int64_t m, void* scratch, int tid, int nt) const override {
    const int64_t ld = 2 * w_.kp;
    if (ld == k_) return;
    int64_t b, e;
    team_share(m, tid, nt, b, e);
    float* out = static_cast<float*>(scratch);
    for (int64_t r = b; r < e; ++r) {
      std::copy(x + r * k_, x + (r + 1) * k_, out + r * ld);
      std::fill(out + r * ld + k_, out + (r + 1) * ld, 0.0f);
    }
  }

  void team_gemm(const float* x, const void* scratch, int64_t m, float* y, int64_t ldy, const float* bias,
                         int tid, int nt) const override {
    const int lt = std::min<int>(threads_, nt);
    if (tid >= lt) return;
    int64_t b, e;
    team_share(w_.nb, tid, lt, b, e);
    if (b == e) return;
    DenseWeights w = w_;
    w.bias = bias;
    const int64_t ld = 2 * w_.kp;
    const DenseActs a{ld == k_ ? x : static_cast<const float*>(scratch), ld, int32_t(m)};
    gemm_(w, a, Out{y, ldy, DType::F32}, int(b), int(e));
  }

  // x [..., K] float32 / bfloat16 / float16 -> y [..., N] of x's dtype (+ bias [N])
  at::Tensor forward(const at::Tensor& x_in, const std::optional<at::Tensor>& bias_in) const {
    const auto dt = x_in.scalar_type();
    if (x_in.dim() < 1 || x_in.size(-1) != k_ || x_in.device().is_cuda() ||
        !(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf)) {
      std::ostringstream s;
      s << x_in.dtype() << " " << x_in.sizes();
      dense_fail("native dense: input should be a float32/bfloat16/float16 CPU tensor [..., ", k_, "], found ", s.str());
    }
    const int64_t m = x_in.numel() / k_, ld = 2 * w_.kp;
    // float32 activations [M, 2 * KP] (widened exactly; the odd K's last pair padded with 0)
    at::Tensor x = x_in.reshape({m, k_});
    if (dt != at::kFloat || ld != k_ || !x.is_contiguous()) {
      at::Tensor t = at::zeros({m, ld}, x.options().dtype(at::kFloat));
      t.narrow(1, 0, k_).copy_(x);
      x = t;
    }
    at::Tensor bias;
    if (bias_in) {
      bias = bias_in->to(at::kFloat).contiguous();
      if (bias.dim() != 1 || bias.size(0) != w_.n) dense_fail("native dense: bias should have ", w_.n, " values");
    }
    const auto out_dt = dt == at::kHalf ? at::kFloat : dt;  // float16 results are rounded by torch
    at::Tensor y = at::empty({m, w_.n}, x.options().dtype(out_dt));
    DenseWeights w = w_;
    w.bias = bias.defined() ? bias.data_ptr<float>() : nullptr;
    const float* xp = x.data_ptr<float>();
    for (int64_t m0 = 0; m0 < m; m0 += MAX_BLOCK_TOKENS) {  // the kernels' partial sums hold that many
      const int32_t mb = int32_t(std::min<int64_t>(MAX_BLOCK_TOKENS, m - m0));
      const DenseActs a{xp + m0 * ld, ld, mb};
      const Out o{static_cast<char*>(y.data_ptr()) + m0 * w_.n * y.element_size(), w_.n,
                  out_dt == at::kBFloat16 ? DType::BF16 : DType::F32};
      const int64_t bytes = int64_t(w_.nb) * w_.kp * 128 * (1 + mb / 4);
      parallel_parts(threads_for(threads_, bytes, w_.nb), w_.nb,
                     [&](int64_t b, int64_t e) { gemm_(w, a, o, int(b), int(e)); });
    }
    std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
    shape.back() = w_.n;
    return (dt == at::kHalf ? y.to(at::kHalf) : y).view(shape);
  }

 private:
  at::Tensor words_;
  std::string isa_;
  DenseGemm gemm_;
  DenseWeights w_;
  int64_t k_ = 0;
  int threads_ = 1;
};

}  // namespace

void register_dense(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<NativeDense, LinearOp>(m, "NativeDense")
      .def(py::init<at::Tensor, int64_t, int64_t, std::string, std::string, int64_t>(), py::arg("words"),
           py::arg("n"), py::arg("k"), py::arg("dtype"), py::arg("isa"), py::arg("threads") = 1)
      .def("forward", &NativeDense::forward, py::arg("x"), py::arg("bias") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("set_threads", &NativeDense::set_threads)
      .def_property_readonly("threads", &NativeDense::threads)
      .def_property_readonly("isa", &NativeDense::isa);
}

}  // namespace quill
