// One token's routed experts in one call: y = sum_j w_j * down_j(silu(gate_j x) * up_j x) over the k
// experts the router chose, gate and up stacked into one [2I, H] linear per expert.
//
// Why: one decode token of an MoE layer runs 2k small linears (Qwen3-30B-A3B's shapes: 8 experts,
// 1.8 MB gate_up and 0.9 MB down each).  Called one by one from Python each paid its own
// fork/join, its own prefetch ramp and the glue between them (silu, mul, weighted adds): the layer
// read its 18.6 MiB at 65 % of the DRAM rate on Zen 5.  Here one parallel region runs them all,
// each linear split by row blocks across the team (LinearOp's team calls, as the decode step
// does), with the team's barrier between dependent phases.
//
// Arithmetic: each expert's linears give run()'s bits; silu-mul is ops.cpp's; the weighted sum
// is y = w_0 * o_0, then y = y + w_j * o_j in routing order, each product and sum rounded to
// float32 (no FMA contraction in this build).  float32 only.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <string>
#include <vector>

#include "linear_op.h"
#include "ops.h"
#include "team.h"

namespace quill {
namespace {

template <class... A>
[[noreturn]] void fail(const A&... parts) {
  op_fail("expert group", parts...);
}

class ExpertGroup {
 public:
  ExpertGroup(int64_t hidden, int64_t intermediate) : h_(hidden), i_(intermediate) {
    if (h_ < 1 || i_ < 1) fail("hidden ", h_, " and intermediate ", i_, " should be positive");
  }

  // The linears are borrowed: their Python objects are kept alive by the group's (keep_alive below).
  void add_expert(LinearOp* gate_up, LinearOp* down) {
    const int64_t e = int64_t(gate_up_.size());
    if (gate_up == nullptr || down == nullptr) fail("expert ", e, ": gate_up and down are required");
    if (gate_up->in_features() != h_ || gate_up->out_features() != 2 * i_)
      fail("expert ", e, ": gate_up is [", gate_up->out_features(), ", ", gate_up->in_features(), "], expected [",
           2 * i_, ", ", h_, "]");
    if (down->in_features() != i_ || down->out_features() != h_)
      fail("expert ", e, ": down is [", down->out_features(), ", ", down->in_features(), "], expected [", h_, ", ",
           i_, "]");
    const int64_t a = gate_up->team_scratch(1), b = down->team_scratch(1);
    if (a < 0 || b < 0) fail("expert ", e, ": a linear cannot run one token in a team call");
    scratch_ = std::max({scratch_, a, b});
    threads_ = std::max({threads_, gate_up->threads(), down->threads()});
    gate_up_.push_back(gate_up);
    down_.push_back(down);
  }

  int64_t num_experts() const { return int64_t(gate_up_.size()); }

  // x float32 [1, H], ids int64 [k] (experts, in routing order), weights float32 [k] -> y float32 [1, H]
  at::Tensor forward(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights) const {
    if (x.scalar_type() != at::kFloat || x.sizes() != at::IntArrayRef({1, h_}) || !x.is_contiguous())
      fail("'x' should be contiguous float32 [1, ", h_, "], found ", x.dtype(), " ", x.sizes());
    if (ids.scalar_type() != at::kLong || ids.dim() != 1 || ids.size(0) < 1 || !ids.is_contiguous())
      fail("'ids' should be contiguous int64 [k], k >= 1, found ", ids.dtype(), " ", ids.sizes());
    const int64_t k = ids.size(0);
    if (weights.scalar_type() != at::kFloat || weights.sizes() != at::IntArrayRef({k}) || !weights.is_contiguous())
      fail("'weights' should be contiguous float32 [", k, "], found ", weights.dtype(), " ", weights.sizes());
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t j = 0; j < k; ++j)
      if (id[j] < 0 || id[j] >= num_experts()) fail("ids[", j, "] = ", id[j], "; the group has ", num_experts());
    // [k, 2I] gate_up outputs, [k, I] activations, [k, H] expert outputs, [H] the sum
    const int64_t gu_n = align64(k * 2 * i_ * 4) / 4, act_n = align64(k * i_ * 4) / 4, out_n = align64(k * h_ * 4) / 4;
    at::Tensor mem = at::empty({gu_n + act_n + out_n + h_}, x.options());
    at::Tensor scratch_mem = at::empty({std::max<int64_t>(scratch_, 64)}, x.options().dtype(at::kByte));
    float* gu = mem.data_ptr<float>();
    float* act = gu + gu_n;
    float* out = act + act_n;
    float* y = out + out_n;
    char* scratch = static_cast<char*>(scratch_mem.data_ptr());
    const float* xp = x.data_ptr<float>();
    const float* w = weights.data_ptr<float>();
    const int threads = int(std::max<int64_t>(1, std::min<int64_t>(threads_, at::get_num_threads())));

    SpinBarrier bar;
#pragma omp parallel num_threads(threads)
    {
      const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp single
      bar.set_size(nt);  // (the end of `single` is a barrier)
      for (int64_t j = 0; j < k; ++j) {  // gate_up of every expert: [1, H] -> [1, 2I]
        const LinearOp* op = gate_up_[size_t(id[j])];
        op->team_prepare(xp, 1, scratch, tid, nt);
        bar.wait();
        op->team_gemm(xp, scratch, 1, gu + j * 2 * i_, 2 * i_, nullptr, tid, nt);
        bar.wait();  // the scratch is the next call's
      }
      int64_t e0, e1;  // this thread's elements of [k, I]
      team_share(k * i_, tid, nt, e0, e1);
      for (int64_t j = e0 / i_; j < k && j * i_ < e1; ++j) {
        const int64_t b = std::max(e0, j * i_) - j * i_, e = std::min(e1, (j + 1) * i_) - j * i_;
        silu_mul_f32(gu + j * 2 * i_, gu + j * 2 * i_ + i_, act + j * i_, b, e);
      }
      bar.wait();
      for (int64_t j = 0; j < k; ++j) {  // down of every expert: [1, I] -> [1, H]
        const LinearOp* op = down_[size_t(id[j])];
        op->team_prepare(act + j * i_, 1, scratch, tid, nt);
        bar.wait();
        op->team_gemm(act + j * i_, scratch, 1, out + j * h_, h_, nullptr, tid, nt);
        bar.wait();
      }
      int64_t c0, c1;  // this thread's columns of y
      team_share(h_, tid, nt, c0, c1);
      for (int64_t c = c0; c < c1; ++c) {
        float s = w[0] * out[c];
        for (int64_t j = 1; j < k; ++j) s = s + w[j] * out[j * h_ + c];
        y[c] = s;
      }
    }
    return mem.narrow(0, gu_n + act_n + out_n, h_).view({1, h_});
  }

 private:
  int64_t h_, i_;
  std::vector<LinearOp*> gate_up_, down_;
  int64_t scratch_ = 0;
  int64_t threads_ = 1;
};

}  // namespace

void register_moe(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<ExpertGroup>(m, "ExpertGroup")
      .def(py::init<int64_t, int64_t>(), py::arg("hidden"), py::arg("intermediate"))
      // the group holds the linears' Python objects (their C++ ops are borrowed, not copied)
      .def("add_expert", &ExpertGroup::add_expert, py::arg("gate_up"), py::arg("down"), py::keep_alive<1, 2>(),
           py::keep_alive<1, 3>())
      .def_property_readonly("num_experts", &ExpertGroup::num_experts)
      .def("forward", &ExpertGroup::forward, py::arg("x"), py::arg("ids"), py::arg("weights"),
           py::call_guard<py::gil_scoped_release>());
}

}  // namespace quill
