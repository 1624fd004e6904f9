// Python binding of the MXFP4 linear (mxfp4.h): NativeMxfp4 holds one layer's packed codes and
// E8M0 scales and the chosen ISA variant; forward(x, bias) is the whole per-call path, and the
// team calls (linear_op.h) let the native decode step and the MoE expert group run it.
// int8 activations are quantized by the variant's own quantizer (common.h KernelTable::quantize,
// one scale per token and 32-column group: quill.kernels.activation's per-group arithmetic).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "isa.h"
#include "linear_op.h"
#include "mxfp4.h"
#include "ops.h"
#include "parallel.h"

namespace quill {
namespace {

template <class... A>
[[noreturn]] void mxfp4_fail(const A&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  throw OpFailure(s.str());
}

class NativeMxfp4 final : public LinearOp {
 public:
  // codes uint8 [NB, G, 4, 16, 4], scales uint8 [NB, G, 16] (mxfp4.h); act "float" or "int8"
  NativeMxfp4(at::Tensor codes, at::Tensor scales, int64_t n, int64_t k, std::string act, std::string isa,
              int64_t threads)
      : codes_(std::move(codes)), scales_(std::move(scales)), isa_(isa) {
    const IsaBackend& be = backend_for(isa, "native mxfp4");
    kernels_ = be.mxfp4;
    quantize_ = be.linear->quantize;
    if (act != "float" && act != "int8") mxfp4_fail("native mxfp4: activations '", act, "' are not supported; supported: float, int8");
    int8_ = act == "int8";
    if (n <= 0 || k <= 0 || k % MX_GROUP) mxfp4_fail("native mxfp4: a [", n, ", ", k, "] weight; in_features must be a positive multiple of 32");
    const int64_t nb = (n + LANES - 1) / LANES, g = k / MX_GROUP;
    check(codes_, {nb, g, 4, LANES, 4}, "codes");
    check(scales_, {nb, g, LANES}, "scales");
    w_.codes = codes_.data_ptr<uint8_t>();
    w_.scales = scales_.data_ptr<uint8_t>();
    w_.n = int32_t(n);
    w_.nb = int32_t(nb);
    w_.groups = int32_t(g);
    k_ = k;
    for (int64_t s = 0; s < g; ++s) seg_end_.push_back(int32_t(4 * (s + 1)));  // chunks of 8: 4 per group
    set_threads(threads);
  }

  void set_threads(int64_t t) {
    if (t < 1) mxfp4_fail("native mxfp4: threads must be at least 1, found ", t);
    threads_ = int(t);
  }
  int64_t threads() const override { return threads_; }
  std::string isa() const { return isa_; }
  int64_t in_features() const override { return k_; }
  int64_t out_features() const override { return w_.n; }

  at::Tensor run(const at::Tensor& x, const std::optional<at::Tensor>& bias) override { return forward(x, bias); }

  // Scratch for M tokens: none (float), or the int8 codes [M, K], group scales [M, G] and sums [M, G].
  int64_t team_scratch(int64_t m) const override {
    return int8_ ? align64(m * k_) + 2 * align64(m * w_.groups * 4) : 0;
  }

  void team_prepare(const float* x, int64_t m, void* scratch, int tid, int nt) const override {
    if (!int8_) return;
    int64_t b, e;
    team_share(m, tid, nt, b, e);
    if (b < e) quantize(x, m, static_cast<char*>(scratch), int(b), int(e));
  }

  void team_gemm(const float* x, const void* scratch, int64_t m, float* y, int64_t ldy, const float* bias, int tid,
                 int nt) const override {
    const int lt = std::min<int>(threads_, nt);
    if (tid >= lt) return;
    int64_t b, e;
    team_share(w_.nb, tid, lt, b, e);
    if (b == e) return;
    Mxfp4Weights w = w_;
    w.bias = bias;
    gemm(w, acts(x, static_cast<const char*>(scratch), m), Out{y, ldy, DType::F32}, int(b), int(e));
  }

  // x [..., K] float32 / bfloat16 / float16 -> y [..., N] of x's dtype (+ bias [N]), computed in float32
  at::Tensor forward(const at::Tensor& x_in, const std::optional<at::Tensor>& bias_in) const {
    const auto dt = x_in.scalar_type();
    if (x_in.dim() < 1 || x_in.size(-1) != k_ || x_in.device().is_cuda() ||
        !(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf)) {
      std::ostringstream s;
      s << x_in.dtype() << " " << x_in.sizes();
      mxfp4_fail("native mxfp4: input should be a float32/bfloat16/float16 CPU tensor [..., ", k_, "], found ", s.str());
    }
    const int64_t m = x_in.numel() / k_;
    const at::Tensor x = x_in.reshape({m, k_}).to(at::kFloat).contiguous();
    at::Tensor bias;
    if (bias_in) {
      bias = bias_in->to(at::kFloat).contiguous();
      if (bias.dim() != 1 || bias.size(0) != w_.n) mxfp4_fail("native mxfp4: bias should have ", w_.n, " values");
    }
    at::Tensor y = at::empty({m, w_.n}, x.options());
    at::Tensor scratch = at::empty({std::max<int64_t>(1, team_scratch(m))}, x.options().dtype(at::kByte));
    char* sp = static_cast<char*>(scratch.data_ptr());
    const float* xp = x.data_ptr<float>();
    if (int8_ && m > 0) parallel_parts(threads_for(threads_, m * k_ * 64, m), m, [&](int64_t b, int64_t e) {
      quantize(xp, m, sp, int(b), int(e));
    });
    Mxfp4Weights w = w_;
    w.bias = bias.defined() ? bias.data_ptr<float>() : nullptr;
    const Mxfp4Acts a = acts(xp, sp, m);
    const Out o{y.data_ptr<float>(), w_.n, DType::F32};
    const int64_t bytes = int64_t(w_.nb) * w_.groups * 272 * (1 + m / 4);
    parallel_parts(threads_for(threads_, bytes, w_.nb), w_.nb, [&](int64_t b, int64_t e) { gemm(w, a, o, int(b), int(e)); });
    std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
    shape.back() = w_.n;
    return (dt == at::kFloat ? y : y.to(dt)).view(shape);
  }

 private:
  static void check(const at::Tensor& t, std::vector<int64_t> shape, const char* what) {
    if (t.scalar_type() != at::kByte || !t.is_contiguous() || t.sizes() != at::IntArrayRef(shape)) {
      std::ostringstream s;
      s << "native mxfp4: tensor '" << what << "' should be contiguous uint8 " << at::IntArrayRef(shape) << ", found "
        << t.dtype() << " " << t.sizes();
      mxfp4_fail(s.str());
    }
  }

  // byte offsets in the scratch of M tokens (team_scratch): group scales [M, G], then sums [M, G]
  int64_t gscale_at(int64_t m) const { return align64(m * k_); }
  int64_t qsum_at(int64_t m) const { return align64(m * k_) + align64(m * w_.groups * 4); }

  // tokens [b, e) of x [M, K] quantized into scratch (codes, group scales, sums)
  void quantize(const float* x, int64_t m, char* scratch, int b, int e) const {
    int8_t* q = reinterpret_cast<int8_t*>(scratch);
    float* gscale = reinterpret_cast<float*>(scratch + gscale_at(m));
    int32_t* qsum = reinterpret_cast<int32_t*>(scratch + qsum_at(m));
    RawX in;
    in.x = x;
    in.dtype = DType::F32;
    in.k = k_;
    in.kp = k_;
    in.seg_end = seg_end_.data();
    in.nseg = w_.groups;
    in.chunk = 8;
    ActQuant aq;
    aq.per_segment = true;
    float unused[2];
    quantize_(in, aq, q, qsum, unused, unused + 1, gscale, b, e);
  }

  Mxfp4Acts acts(const float* x, const char* scratch, int64_t m) const {
    Mxfp4Acts a;
    a.x = x;
    a.ld = k_;
    a.m = int32_t(m);
    if (int8_) {
      a.q = reinterpret_cast<const int8_t*>(scratch);
      a.gscale = reinterpret_cast<const float*>(scratch + gscale_at(m));
      a.qsum = reinterpret_cast<const int32_t*>(scratch + qsum_at(m));  // the SIMD kernels' bias term
    }
    return a;
  }

  void gemm(const Mxfp4Weights& w, const Mxfp4Acts& a, const Out& o, int b, int e) const {
    (int8_ ? kernels_->gemm_i8 : kernels_->gemm_f32)(w, a, o, b, e);
  }

  at::Tensor codes_, scales_;
  std::string isa_;
  const Mxfp4Kernels* kernels_ = nullptr;
  void (*quantize_)(const RawX&, const ActQuant&, int8_t*, int32_t*, float*, float*, float*, int, int) = nullptr;
  Mxfp4Weights w_;
  std::vector<int32_t> seg_end_;
  int64_t k_ = 0;
  int threads_ = 1;
  bool int8_ = false;
};

}  // namespace

void register_mxfp4(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<NativeMxfp4, LinearOp>(m, "NativeMxfp4")
      .def(py::init<at::Tensor, at::Tensor, int64_t, int64_t, std::string, std::string, int64_t>(), py::arg("codes"),
           py::arg("scales"), py::arg("n"), py::arg("k"), py::arg("act"), py::arg("isa"), py::arg("threads") = 1)
      .def("forward", &NativeMxfp4::forward, py::arg("x"), py::arg("bias") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("set_threads", &NativeMxfp4::set_threads)
      .def_property_readonly("threads", &NativeMxfp4::threads)
      .def_property_readonly("isa", &NativeMxfp4::isa);
}

}  // namespace quill
