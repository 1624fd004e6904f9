// A decode step of a Llama-family decoder (llama, qwen2, qwen3, Mistral-style) with every layer
// in one call: per layer RMSNorm -> q/k/v projections -> (Qwen3: per-head q/k RMSNorm) -> rope
// -> store k, v in the paged pools -> paged decode attention -> o projection -> residual ->
// RMSNorm -> gate/up -> SiLU-and-multiply -> down -> residual.
//
// Why: a decode step of a small model spent more time in Python module calls and torch op
// dispatch around the kernels than in the kernels (default model: ~4 ms of a 12 ms token).
// Here the same native functions run in the same order on the same shapes as the Python
// layers (quill/models/llama.py through quill/kernels/fused.py), so the result is the Python
// path's bits; quill/engine/native_step.py builds a step only when every piece of every layer
// is one of these native functions, and checks the equality in its tests.
//
// Every token is a decode token (one new token per sequence): h [T, E], position cos/sin
// [1, T, D], the pool slot each token's k/v is written to [T], and each sequence's context
// slots [T, S] and length [T] as the paged attention reads them.  float32 only.
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "linear_op.h"
#include "ops.h"

namespace quill {
namespace {

template <class... A>
[[noreturn]] void fail(const A&... parts) {
  std::ostringstream s;
  s << "decoder step: ";
  (s << ... << parts);
  throw OpFailure(s.str());
}

void expect_f32(const at::Tensor& t, std::vector<int64_t> shape, const char* what) {
  if (t.scalar_type() != at::kFloat || t.sizes() != at::IntArrayRef(shape) || !t.is_contiguous())
    fail("'", what, "' should be contiguous float32 ", at::IntArrayRef(shape), ", found ", t.dtype(), " ", t.sizes());
}

// One linear and its bias.
struct Proj {
  LinearOp* op = nullptr;
  std::optional<at::Tensor> bias;
  at::Tensor operator()(const at::Tensor& x) const { return op->run(x, bias); }  // [T, K] -> [T, N]
};

struct Layer {
  at::Tensor ln1, ln2;  // [E]
  double eps1 = 0, eps2 = 0;
  std::vector<Proj> qkv;      // one merged [T, (H + 2 Hkv) D], or q, k, v
  Proj o;                     // [T, H D] -> [T, E]
  std::vector<Proj> gate_up;  // one merged [T, 2 I], or gate, up
  Proj down;                  // [T, I] -> [T, E]
  std::optional<at::Tensor> q_norm, k_norm;  // [D] (Qwen3)
  double qk_eps = 0;
  at::Tensor k_pool, v_pool;  // [N, Hkv, D]
};

std::vector<Proj> projs(const std::vector<LinearOp*>& ops, const std::vector<std::optional<at::Tensor>>& biases,
                        size_t merged, size_t apart, const char* what) {
  if ((ops.size() != merged && ops.size() != apart) || biases.size() != ops.size())
    fail(what, ": expected ", merged, " merged or ", apart, " separate linears with as many biases, found ",
         ops.size(), " and ", biases.size());
  std::vector<Proj> out;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i] == nullptr) fail(what, ": linear ", i, " is None");
    out.push_back({ops[i], biases[i]});
  }
  return out;
}

// Column blocks [offset, offset + width) of one merged output, or the separate outputs.
std::vector<at::Tensor> outputs(const std::vector<Proj>& ps, const at::Tensor& x, const std::vector<int64_t>& widths,
                                const char* what) {
  std::vector<at::Tensor> out;
  if (ps.size() == 1) {
    const at::Tensor y = ps[0](x);  // [T, sum(widths)]
    int64_t total = 0;
    for (int64_t w : widths) total += w;
    if (y.dim() != 2 || y.size(1) != total) fail(what, ": the merged linear gave ", y.sizes(), ", expected [T, ", total, "]");
    int64_t at = 0;
    for (int64_t w : widths) {
      out.push_back(y.narrow(1, at, w));
      at += w;
    }
    return out;
  }
  for (size_t i = 0; i < ps.size(); ++i) {
    out.push_back(ps[i](x));
    if (out.back().dim() != 2 || out.back().size(1) != widths[i])
      fail(what, ": linear ", i, " gave ", out.back().sizes(), ", expected [T, ", widths[i], "]");
  }
  return out;
}

class DecoderStep {
 public:
  DecoderStep(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double scale,
              std::string isa)
      : e_(hidden), h_(heads), hkv_(kv_heads), d_(head_dim), i_(intermediate), scale_(scale), isa_(std::move(isa)) {
    if (e_ < 1 || h_ < 1 || hkv_ < 1 || d_ < 2 || d_ % 2 || i_ < 1 || h_ % hkv_)
      fail("hidden ", e_, ", heads ", h_, ", kv_heads ", hkv_, ", head_dim ", d_, ", intermediate ", i_,
           ": expected positive sizes, an even head_dim and heads a multiple of kv_heads");
  }

  void add_layer(at::Tensor ln1, double eps1, at::Tensor ln2, double eps2, const std::vector<LinearOp*>& qkv,
                 const std::vector<std::optional<at::Tensor>>& qkv_bias, LinearOp* o, std::optional<at::Tensor> o_bias,
                 const std::vector<LinearOp*>& gate_up, const std::vector<std::optional<at::Tensor>>& gate_up_bias,
                 LinearOp* down, std::optional<at::Tensor> down_bias, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, double qk_eps, at::Tensor k_pool, at::Tensor v_pool) {
    expect_f32(ln1, {e_}, "input_layernorm");
    expect_f32(ln2, {e_}, "post_attention_layernorm");
    if (q_norm.has_value() != k_norm.has_value()) fail("q_norm and k_norm come together");
    if (q_norm) expect_f32(*q_norm, {d_}, "q_norm");
    if (k_norm) expect_f32(*k_norm, {d_}, "k_norm");
    if (k_pool.dim() != 3) fail("'k_pool' should be float32 [N, ", hkv_, ", ", d_, "], found ", k_pool.sizes());
    expect_f32(k_pool, {k_pool.size(0), hkv_, d_}, "k_pool");
    expect_f32(v_pool, {k_pool.size(0), hkv_, d_}, "v_pool");
    if (o == nullptr || down == nullptr) fail("o_proj and down_proj are required");
    Layer l;
    l.ln1 = std::move(ln1), l.ln2 = std::move(ln2), l.eps1 = eps1, l.eps2 = eps2;
    l.qkv = projs(qkv, qkv_bias, 1, 3, "q/k/v");
    l.o = {o, std::move(o_bias)};
    l.gate_up = projs(gate_up, gate_up_bias, 1, 2, "gate/up");
    l.down = {down, std::move(down_bias)};
    l.q_norm = std::move(q_norm), l.k_norm = std::move(k_norm), l.qk_eps = qk_eps;
    l.k_pool = std::move(k_pool), l.v_pool = std::move(v_pool);
    layers_.push_back(std::move(l));
  }

  int64_t num_layers() const { return int64_t(layers_.size()); }

  // h [T, E]; cos, sin [1, T, D]; slots int64 [T]; ctx_slots int64 [T, S]; lens int64 [T] -> [T, E]
  at::Tensor forward(const at::Tensor& h_in, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                     const at::Tensor& ctx_slots, const at::Tensor& lens) const {
    if (h_in.dim() != 2) fail("'h' should be float32 [T, ", e_, "], found ", h_in.sizes());
    const int64_t t = h_in.size(0);
    expect_f32(h_in, {t, e_}, "h");
    expect_f32(cos, {1, t, d_}, "cos");
    expect_f32(sin, {1, t, d_}, "sin");
    if (slots.scalar_type() != at::kLong || slots.sizes() != at::IntArrayRef({t}) || !slots.is_contiguous())
      fail("'slots' should be contiguous int64 [", t, "], found ", slots.dtype(), " ", slots.sizes());
    const int64_t* sl = slots.data_ptr<int64_t>();
    for (const Layer& l : layers_)
      for (int64_t i = 0; i < t; ++i)
        if (sl[i] < 0 || sl[i] >= l.k_pool.size(0))
          fail("token ", i, " writes pool row ", sl[i], "; the pool has ", l.k_pool.size(0));
    at::Tensor h = h_in;
    for (const Layer& l : layers_) {
      h = at::add(h, attention(l, rms_norm(h, l.ln1, l.eps1), cos, sin, sl, ctx_slots, lens));
      h = at::add(h, mlp(l, rms_norm(h, l.ln2, l.eps2)));
    }
    return h;
  }

 private:
  // x [T, E] -> [T, E]
  at::Tensor attention(const Layer& l, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                       const int64_t* slots, const at::Tensor& ctx_slots, const at::Tensor& lens) const {
    const int64_t t = x.size(0);
    std::vector<at::Tensor> qkv = outputs(l.qkv, x, {h_ * d_, hkv_ * d_, hkv_ * d_}, "q/k/v");
    at::Tensor q = qkv[0].reshape({1, t, h_, d_}), k = qkv[1].reshape({1, t, hkv_, d_});
    q = l.q_norm ? rms_norm(q, *l.q_norm, l.qk_eps) : q.contiguous();  // [1, T, H, D]
    k = l.k_norm ? rms_norm(k, *l.k_norm, l.qk_eps) : k.contiguous();  // [1, T, Hkv, D]
    rope_(q, cos, sin);
    rope_(k, cos, sin);
    const at::Tensor& v = qkv[2];  // [T, Hkv D], rows `v.stride(0)` apart
    const int64_t row = hkv_ * d_;
    float* kp = l.k_pool.data_ptr<float>();
    float* vp = l.v_pool.data_ptr<float>();
    const float* kr = k.data_ptr<float>();
    const float* vr = v.data_ptr<float>();
    for (int64_t i = 0; i < t; ++i) {
      std::memcpy(kp + slots[i] * row, kr + i * row, size_t(row) * sizeof(float));
      std::memcpy(vp + slots[i] * row, vr + i * v.stride(0), size_t(row) * sizeof(float));
    }
    const at::Tensor out = paged_decode_attention(q.view({t, h_, 1, d_}), l.k_pool, l.v_pool, ctx_slots, lens,
                                                  scale_, isa_);  // [T, H, 1, D]
    return l.o(out.view({t, h_ * d_}));
  }

  // x [T, E] -> [T, E]
  at::Tensor mlp(const Layer& l, const at::Tensor& x) const {
    std::vector<at::Tensor> gu = outputs(l.gate_up, x, {i_, i_}, "gate/up");
    return l.down(silu_mul(gu[0], gu[1]));
  }

  int64_t e_, h_, hkv_, d_, i_;
  double scale_;
  std::string isa_;
  std::vector<Layer> layers_;
};

}  // namespace

void register_step(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<DecoderStep>(m, "DecoderStep")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, std::string>(), py::arg("hidden"),
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"), py::arg("scale"),
           py::arg("isa"))
      // the linears are borrowed: the caller keeps their Python objects alive as long as the step
      .def("add_layer", &DecoderStep::add_layer, py::arg("ln1"), py::arg("eps1"), py::arg("ln2"), py::arg("eps2"),
           py::arg("qkv"), py::arg("qkv_bias"), py::arg("o"), py::arg("o_bias"), py::arg("gate_up"),
           py::arg("gate_up_bias"), py::arg("down"), py::arg("down_bias"), py::arg("q_norm"), py::arg("k_norm"),
           py::arg("qk_eps"), py::arg("k_pool"), py::arg("v_pool"))
      .def_property_readonly("num_layers", &DecoderStep::num_layers)
      .def("forward", &DecoderStep::forward, py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("slots"),
           py::arg("ctx_slots"), py::arg("lens"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace quill
