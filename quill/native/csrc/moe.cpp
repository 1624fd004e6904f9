// The routed experts of an MoE layer (moe.h): y = sum_j w_j * down_j(act(gate_j x, up_j x)), act SiLU-and-
// multiply or gpt-oss's clamped SwiGLU, the linears with their biases or none.
//
// Why one native object: one decode token of an MoE layer runs 2k small linears (Qwen3-30B-A3B's
// shapes: 8 experts, 1.8 MB gate_up and 0.9 MB down each).  Called one by one from Python each
// paid its own fork/join, its own prefetch ramp and the glue between them (silu, mul, weighted
// adds): the layer read its 18.6 MiB at 65 % of the DRAM rate on Zen 5.  Here one parallel region
// runs them all, each linear split by row blocks across the team (LinearOp's team calls), with the
// team's barrier between dependent phases; the native decode step (step.cpp) runs the same phases
// inside its own region.
//
// Order of work: the (token, slot) pairs are laid out in "positions": one token's slots in
// routing order; several tokens' sorted by expert (stable), so each expert that received tokens
// runs once on all of them (its weights read once per call, one GEMM of exactly its token count).
// Arithmetic: each expert's linears give run()'s bits (bias included); the activation is ops.cpp's; token r's output is
// y = p_0, then y = y + p_j over its positions in ascending order, p = w * out rounded to float32
// (no FMA contraction in this build).  float32 only.
#include "moe.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <omp.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "ops.h"

namespace quill {

namespace {

template <class... A>
[[noreturn]] void moe_fail(const A&... parts) {
  op_fail("expert group", parts...);
}

// (value, id) ordering of the router: larger logit first, the lower id on ties, NaN as -inf
inline bool better(float a, int64_t ia, float b, int64_t ib) {
  const float inf = std::numeric_limits<float>::infinity();
  a = std::isnan(a) ? -inf : a;
  b = std::isnan(b) ? -inf : b;
  return a > b || (a == b && ia < ib);
}

}  // namespace

void route_token(const float* logits, int64_t e, int64_t k, bool renormalize, int64_t* ids, float* weights) {
  float most = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < e; ++i) most = std::max(most, logits[i]);
  double sum = 0;
  for (int64_t i = 0; i < e; ++i) sum += std::exp(double(logits[i]) - double(most));
  // the j-th best is the best of those ranked below the (j-1)-th: k passes, no memory
  for (int64_t j = 0; j < k; ++j) {
    int64_t pick = -1;
    for (int64_t i = 0; i < e; ++i) {
      if (j > 0 && !better(logits[ids[j - 1]], ids[j - 1], logits[i], i)) continue;
      if (pick < 0 || better(logits[i], i, logits[pick], pick)) pick = i;
    }
    ids[j] = pick;
  }
  double chosen = 0;
  for (int64_t j = 0; j < k; ++j) chosen += std::exp(double(logits[ids[j]]) - double(most)) / sum;
  for (int64_t j = 0; j < k; ++j) {
    const double p = std::exp(double(logits[ids[j]]) - double(most)) / sum;
    weights[j] = float(renormalize ? p / chosen : p);
  }
}

struct ExpertGroup::Work {
  int64_t* counts;  // [E + 1] slots per expert, then where each expert's run starts
  int64_t* order;   // [T k] the slot (token * k + j) at each position
  int64_t* inv;     // [T k] the position of each slot
  int64_t* tokpos;  // [T k] each token's positions, ascending
  float *xs, *gu, *act, *out;  // [T k, H] inputs, [T k, 2I], [T k, I], [T k, H] outputs, by position
  char* solo;                  // each thread's own scratch for one token (solo_stride bytes apart)
};

ExpertGroup::ExpertGroup(int64_t hidden, int64_t intermediate, const std::string& act, double alpha, double limit)
    : h_(hidden), i_(intermediate), clamped_(act == "swiglu_clamped"), gelu_(act == "gelu_tanh"), alpha_(float(alpha)),
      limit_(float(limit)) {
  if (h_ < 1 || i_ < 1) moe_fail("hidden ", h_, " and intermediate ", i_, " should be positive");
  if (act != "silu" && !clamped_ && !gelu_)
    moe_fail("activation '", act, "': expected silu, gelu_tanh or swiglu_clamped");
  if (clamped_ && !(alpha > 0 && limit > 0))
    moe_fail("swiglu_clamped: alpha ", alpha, " and limit ", limit, " should be positive");
}

namespace {

// A bias of `n` as float32 (what the linears' team calls take), undefined for none.
at::Tensor bias_f32(const std::optional<at::Tensor>& b, int64_t n, int64_t e, const char* what) {
  if (!b || !b->defined()) return {};
  if (b->dim() != 1 || b->size(0) != n) moe_fail("expert ", e, ": ", what, " bias is ", b->sizes(), ", expected [", n, "]");
  return b->to(at::kFloat).contiguous();
}

}  // namespace

void ExpertGroup::add_expert(LinearOp* gate_up, LinearOp* down, const std::optional<at::Tensor>& gate_up_bias,
                             const std::optional<at::Tensor>& down_bias) {
  const int64_t e = num_experts();
  if (gate_up == nullptr || down == nullptr) moe_fail("expert ", e, ": gate_up and down are required");
  if (gate_up->in_features() != h_ || gate_up->out_features() != 2 * i_)
    moe_fail("expert ", e, ": gate_up is [", gate_up->out_features(), ", ", gate_up->in_features(), "], expected [",
         2 * i_, ", ", h_, "]");
  if (down->in_features() != i_ || down->out_features() != h_)
    moe_fail("expert ", e, ": down is [", down->out_features(), ", ", down->in_features(), "], expected [", h_, ", ", i_,
         "]");
  const int64_t a = gate_up->team_scratch(1), b = down->team_scratch(1);
  if (a < 0 || b < 0) moe_fail("expert ", e, ": a linear cannot run one token in a team call");
  scratch1_ = std::max({scratch1_, a, b});
  threads_ = std::max({threads_, gate_up->threads(), down->threads()});
  gate_up_bias_.push_back(bias_f32(gate_up_bias, 2 * i_, e, "gate_up"));
  down_bias_.push_back(bias_f32(down_bias, h_, e, "down"));
  gate_up_.push_back(gate_up);
  down_.push_back(down);
}

void ExpertGroup::act(const float* gu, float* y, int64_t b, int64_t e) const {
  if (clamped_)
    swiglu_clamped_f32(gu, gu + i_, y, alpha_, limit_, b, e);
  else if (gelu_)  // Gemma 4's experts
    gelu_tanh_mul_f32(gu, gu + i_, y, b, e);
  else
    silu_mul_f32(gu, gu + i_, y, b, e);
}

int64_t ExpertGroup::team_scratch(int64_t m) const {
  if (m == 1) return scratch1_;
  int64_t most = 0;
  for (size_t e = 0; e < gate_up_.size(); ++e) {
    const int64_t a = gate_up_[e]->team_scratch(m), b = down_[e]->team_scratch(m);
    if (a < 0 || b < 0) return -1;
    most = std::max({most, a, b});
  }
  return most;
}

int64_t ExpertGroup::work_bytes(int64_t t, int64_t k, int threads) const {
  const int64_t n = t * k;
  return align64((num_experts() + 1) * 8) + 3 * align64(n * 8) + align64(n * h_ * 4) * 2 + align64(n * 2 * i_ * 4) +
         align64(n * i_ * 4) + threads * align64(scratch1_);
}

ExpertGroup::Work ExpertGroup::carve(char* work, int64_t t, int64_t k) const {
  const int64_t n = t * k;
  Work w;
  auto take = [&](int64_t bytes) {
    char* p = work;
    work += align64(bytes);
    return p;
  };
  w.counts = reinterpret_cast<int64_t*>(take((num_experts() + 1) * 8));
  w.order = reinterpret_cast<int64_t*>(take(n * 8));
  w.inv = reinterpret_cast<int64_t*>(take(n * 8));
  w.tokpos = reinterpret_cast<int64_t*>(take(n * 8));
  w.xs = reinterpret_cast<float*>(take(n * h_ * 4));
  w.gu = reinterpret_cast<float*>(take(n * 2 * i_ * 4));
  w.act = reinterpret_cast<float*>(take(n * i_ * 4));
  w.out = reinterpret_cast<float*>(take(n * h_ * 4));
  w.solo = work;
  return w;
}

// One thread: the positions (routing order for one token, else a stable sort by expert) and each
// token's positions in ascending order.
void ExpertGroup::plan(const int64_t* ids, int64_t t, int64_t k, const Work& wk) const {
  const int64_t n = t * k;
  if (t == 1) {
    for (int64_t s = 0; s < n; ++s) wk.order[s] = s;
  } else {
    std::fill(wk.counts, wk.counts + num_experts() + 1, 0);
    for (int64_t s = 0; s < n; ++s) ++wk.counts[ids[s] + 1];
    for (int64_t e = 0; e < num_experts(); ++e) wk.counts[e + 1] += wk.counts[e];
    for (int64_t s = 0; s < n; ++s) wk.order[wk.counts[ids[s]]++] = s;
  }
  for (int64_t p = 0; p < n; ++p) wk.inv[wk.order[p]] = p;
  for (int64_t r = 0; r < t; ++r) {
    int64_t* tp = wk.tokpos + r * k;
    std::copy(wk.inv + r * k, wk.inv + (r + 1) * k, tp);
    std::sort(tp, tp + k);
  }
}

namespace {

// End of the run of positions starting at p: one position for a single token, else every
// following position of the same expert.
inline int64_t run_end(const int64_t* order, const int64_t* ids, int64_t p, int64_t n, int64_t t) {
  int64_t q = p + 1;
  if (t > 1)
    while (q < n && ids[order[q]] == ids[order[p]]) ++q;
  return q;
}

// The ops path's bias argument: the held float32 bias, or none.
inline std::optional<at::Tensor> opt(const at::Tensor& bias) {
  return bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
}

}  // namespace

void ExpertGroup::combine(const Work& wk, const float* w, int64_t t, int64_t k, float* y, int64_t c0,
                          int64_t c1) const {
  for (int64_t r = 0; r < t; ++r) {
    const int64_t* tp = wk.tokpos + r * k;
    for (int64_t c = c0; c < c1; ++c) {
      float s = w[wk.order[tp[0]]] * wk.out[tp[0] * h_ + c];
      for (int64_t j = 1; j < k; ++j) s = s + w[wk.order[tp[j]]] * wk.out[tp[j] * h_ + c];
      y[r * h_ + c] = s;
    }
  }
}

void ExpertGroup::team_forward(const float* x, int64_t t, const int64_t* ids, const float* w, int64_t k, float* y,
                               char* work, char* scratch, int tid, int nt, SpinBarrier& bar) const {
  const int64_t n = t * k;
  const Work wk = carve(work, t, k);
  if (tid == 0) plan(ids, t, k, wk);
  if (t == 1 && nt > 1 && k % nt == 0) {  // one token: whole experts per thread, no barrier between them
    solo(x, ids, k, wk, tid, nt);
    bar.wait();
    int64_t c0, c1;
    team_share(h_, tid, nt, c0, c1);
    combine(wk, w, t, k, y, c0, c1);
    bar.wait();
    return;
  }
  bar.wait();
  int64_t s0, s1;  // this thread's positions
  team_share(n, tid, nt, s0, s1);
  for (int64_t p = s0; p < s1; ++p) std::copy(x + wk.order[p] / k * h_, x + (wk.order[p] / k + 1) * h_, wk.xs + p * h_);
  bar.wait();
  for (int64_t p = 0, q; p < n; p = q) {  // gate_up of every run: [m, H] -> [m, 2I]
    q = run_end(wk.order, ids, p, n, t);
    const size_t ex = size_t(ids[wk.order[p]]);
    const LinearOp* op = gate_up_[ex];
    op->team_prepare(wk.xs + p * h_, q - p, scratch, tid, nt);
    bar.wait();
    op->team_gemm(wk.xs + p * h_, scratch, q - p, wk.gu + p * 2 * i_, 2 * i_, ptr(gate_up_bias_[ex]), tid, nt);
    bar.wait();  // the scratch is the next call's
  }
  int64_t e0, e1;  // this thread's elements of [T k, I]
  team_share(n * i_, tid, nt, e0, e1);
  for (int64_t p = e0 / i_; p < n && p * i_ < e1; ++p) {
    const int64_t b = std::max(e0, p * i_) - p * i_, e = std::min(e1, (p + 1) * i_) - p * i_;
    act(wk.gu + p * 2 * i_, wk.act + p * i_, b, e);
  }
  bar.wait();
  for (int64_t p = 0, q; p < n; p = q) {  // down of every run: [m, I] -> [m, H]
    q = run_end(wk.order, ids, p, n, t);
    const size_t ex = size_t(ids[wk.order[p]]);
    const LinearOp* op = down_[ex];
    op->team_prepare(wk.act + p * i_, q - p, scratch, tid, nt);
    bar.wait();
    op->team_gemm(wk.act + p * i_, scratch, q - p, wk.out + p * h_, h_, ptr(down_bias_[ex]), tid, nt);
    bar.wait();
  }
  int64_t c0, c1;  // this thread's columns of y
  team_share(h_, tid, nt, c0, c1);
  combine(wk, w, t, k, y, c0, c1);
  bar.wait();
}

// One token's experts k/nt per thread, each expert's linears run by that thread alone (a team of
// one: the same bits).  Why: split by row blocks, each of the 2k small linears cost two barriers
// and a prefetch ramp per thread; whole experts stream without either.
void ExpertGroup::solo(const float* x, const int64_t* ids, int64_t k, const Work& wk, int tid, int nt) const {
  char* mine = wk.solo + tid * align64(scratch1_);
  for (int64_t j = tid * k / nt; j < (tid + 1) * k / nt; ++j) {
    const size_t ex = size_t(ids[j]);
    const LinearOp* gu = gate_up_[ex];
    const LinearOp* down = down_[ex];
    gu->team_prepare(x, 1, mine, 0, 1);
    gu->team_gemm(x, mine, 1, wk.gu + j * 2 * i_, 2 * i_, ptr(gate_up_bias_[ex]), 0, 1);
    act(wk.gu + j * 2 * i_, wk.act + j * i_, 0, i_);
    down->team_prepare(wk.act + j * i_, 1, mine, 0, 1);
    down->team_gemm(wk.act + j * i_, mine, 1, wk.out + j * h_, h_, ptr(down_bias_[ex]), 0, 1);
  }
}

// The same phases through the linears' own calls (each splitting its own work).
void ExpertGroup::ops_forward(const float* x, int64_t t, const int64_t* ids, const float* w, int64_t k, float* y,
                              char* work) const {
  const int64_t n = t * k;
  const Work wk = carve(work, t, k);
  plan(ids, t, k, wk);
  for (int64_t p = 0; p < n; ++p) std::copy(x + wk.order[p] / k * h_, x + (wk.order[p] / k + 1) * h_, wk.xs + p * h_);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  for (int64_t p = 0, q; p < n; p = q) {
    q = run_end(wk.order, ids, p, n, t);
    const size_t e = size_t(ids[wk.order[p]]);
    const at::Tensor xin = at::from_blob(wk.xs + p * h_, {q - p, h_}, f32);
    const at::Tensor gu = gate_up_[e]->run(xin, opt(gate_up_bias_[e])).contiguous();  // [m, 2I]
    for (int64_t r = 0; r < q - p; ++r) act(gu.data_ptr<float>() + r * 2 * i_, wk.act + (p + r) * i_, 0, i_);
    const at::Tensor a = at::from_blob(wk.act + p * i_, {q - p, i_}, f32);
    const at::Tensor o = down_[e]->run(a, opt(down_bias_[e])).contiguous();  // [m, H]
    std::copy(o.data_ptr<float>(), o.data_ptr<float>() + (q - p) * h_, wk.out + p * h_);
  }
  combine(wk, w, t, k, y, 0, h_);
}

at::Tensor ExpertGroup::forward(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, bool team) const {
  if (x.scalar_type() != at::kFloat || x.dim() != 2 || x.size(1) != h_ || x.size(0) < 1 || !x.is_contiguous())
    moe_fail("'x' should be contiguous float32 [T, ", h_, "], T >= 1, found ", x.dtype(), " ", x.sizes());
  const int64_t t = x.size(0);
  if (ids.scalar_type() != at::kLong || ids.dim() != 2 || ids.size(0) != t || ids.size(1) < 1 || !ids.is_contiguous())
    moe_fail("'ids' should be contiguous int64 [", t, ", k], k >= 1, found ", ids.dtype(), " ", ids.sizes());
  const int64_t k = ids.size(1);
  if (weights.scalar_type() != at::kFloat || weights.sizes() != ids.sizes() || !weights.is_contiguous())
    moe_fail("'weights' should be contiguous float32 ", ids.sizes(), ", found ", weights.dtype(), " ", weights.sizes());
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t s = 0; s < t * k; ++s)
    if (id[s] < 0 || id[s] >= num_experts())
      moe_fail("ids[", s / k, ", ", s % k, "] = ", id[s], "; the group has ", num_experts());
  at::Tensor y = at::empty({t, h_}, x.options());
  const int threads = int(std::max<int64_t>(1, std::min<int64_t>(threads_, at::get_num_threads())));
  at::Tensor work_mem = at::empty({work_bytes(t, k, threads)}, x.options().dtype(at::kByte));
  char* work = static_cast<char*>(work_mem.data_ptr());
  const float* xp = x.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  // the longest run: the most slots one expert receives (one token's slots each run alone)
  int64_t most = 1;
  if (t > 1) {
    std::vector<int64_t> per(size_t(num_experts()), 0);
    for (int64_t s = 0; s < t * k; ++s) most = std::max(most, ++per[size_t(id[s])]);
  }
  const int64_t scratch_bytes = team ? team_scratch(most) : -1;
  if (scratch_bytes < 0) {
    ops_forward(xp, t, id, w, k, y.data_ptr<float>(), work);
    return y;
  }
  at::Tensor scratch_mem = at::empty({std::max<int64_t>(scratch_bytes, 64)}, x.options().dtype(at::kByte));
  char* scratch = static_cast<char*>(scratch_mem.data_ptr());
  float* yp = y.data_ptr<float>();
  SpinBarrier bar;
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp single
    bar.set_size(nt);  // (the end of `single` is a barrier)
    team_forward(xp, t, id, w, k, yp, work, scratch, tid, nt, bar);
  }
  return y;
}

std::tuple<at::Tensor, at::Tensor> route_tokens(const at::Tensor& logits, int64_t k, bool renormalize) {
  if (logits.scalar_type() != at::kFloat || logits.dim() != 2 || !logits.is_contiguous())
    op_fail("moe_route", "'logits' should be contiguous float32 [T, E], found ", logits.dtype(), " ", logits.sizes());
  const int64_t t = logits.size(0), e = logits.size(1);
  if (k < 1 || k > e) op_fail("moe_route", "top_k ", k, " should be in [1, ", e, "] (the experts)");
  at::Tensor w = at::empty({t, k}, logits.options());
  at::Tensor ids = at::empty({t, k}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  for (int64_t r = 0; r < t; ++r)
    route_token(lp + r * e, e, k, renormalize, ids.data_ptr<int64_t>() + r * k, w.data_ptr<float>() + r * k);
  return {w, ids};
}

void register_moe(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<ExpertGroup>(m, "ExpertGroup")
      .def(py::init<int64_t, int64_t, const std::string&, double, double>(), py::arg("hidden"),
           py::arg("intermediate"), py::arg("activation") = "silu", py::arg("alpha") = 0.0, py::arg("limit") = 0.0)
      // the group holds the linears' Python objects (their C++ ops are borrowed, not copied)
      .def("add_expert", &ExpertGroup::add_expert, py::arg("gate_up"), py::arg("down"),
           py::arg("gate_up_bias") = std::nullopt, py::arg("down_bias") = std::nullopt, py::keep_alive<1, 2>(),
           py::keep_alive<1, 3>())
      .def_property_readonly("num_experts", &ExpertGroup::num_experts)
      .def("forward", &ExpertGroup::forward, py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("team") = true,
           py::call_guard<py::gil_scoped_release>());
  m.def("moe_route", &route_tokens, py::arg("logits"), py::arg("top_k"), py::arg("renormalize"),
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace quill
