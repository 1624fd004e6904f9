// Fused element-wise ops of a decoder layer (RMSNorm, rotary embedding of q and k,
// SiLU- and gelu-tanh-and-multiply): one call each instead of 4-16 small torch ops, whose fixed cost
// (~1-2 us each) dominates a decode step's time outside the linears.
//
// Plain C++ (baseline x86-64, vectorised by the compiler): the vectors are a few
// thousand elements.  Each op performs the arithmetic of its torch spelling in
// quill/kernels/fused.py, rounding to the tensor's dtype where torch rounds, so
// float32 results match torch up to summation order (RMSNorm) or exactly
// (rope), and 16-bit results round the same intermediate values (gpt-oss's clamped SwiGLU: float32,
// its own arithmetic, within rounding of its torch spelling in quill/moe/config.py).  Rows are split
// across torch's pool only when there are many of them (prefill).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "ops.h"
#include "vmath.h"

namespace quill {
namespace {

// Element access of one 16/32-bit float dtype, with torch's rounding on store.
template <class T>
struct Elem;

template <>
struct Elem<float> {
  static float load(const float* p, int64_t i) { return p[i]; }
  static float round(float v) { return v; }
  static void store(float* p, int64_t i, float v) { p[i] = v; }
};

template <>
struct Elem<at::BFloat16> {
  static float load(const at::BFloat16* p, int64_t i) { return float(p[i]); }
  static float round(float v) { return float(at::BFloat16(v)); }  // nearest even
  static void store(at::BFloat16* p, int64_t i, float v) { p[i] = at::BFloat16(v); }
};

template <>
struct Elem<at::Half> {
  static float load(const at::Half* p, int64_t i) { return float(p[i]); }
  static float round(float v) { return float(at::Half(v)); }
  static void store(at::Half* p, int64_t i, float v) { p[i] = at::Half(v); }
};

[[noreturn]] void bad(const std::string& what) { throw OpFailure(what); }

void check_float(const at::Tensor& t, const char* op, const char* name) {
  if (t.device().is_cuda() || !(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
                                t.scalar_type() == at::kHalf)) {
    std::ostringstream s;
    s << op << ": '" << name << "' should be a CPU float32/bfloat16/float16 tensor, found " << t.dtype() << " "
      << t.sizes();
    bad(s.str());
  }
}

void same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op, const char* name) {
  if (a.scalar_type() != b.scalar_type()) {
    std::ostringstream s;
    s << op << ": '" << name << "' has dtype " << b.dtype() << ", the input " << a.dtype();
    bad(s.str());
  }
}

// Rows [r0, r1) in parallel when there are enough of them (prefill), else inline.
template <class F>
void rows(int64_t n, int64_t width, const F& body) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1));
  if (n <= grain) return body(0, n);
  at::parallel_for(0, n, grain, body);
}

// ---- RMSNorm: y = w * dtype(x * rsqrt(mean(x^2) + eps)), the mean in float32 ----

template <class T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t d, float eps, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * d;
    float part[8] = {};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
      for (int j = 0; j < 8; ++j) {
        const float v = Elem<T>::load(xr, i + j);
        part[j] += v * v;
      }
    for (int j = 0; i < d; ++i, ++j) {
      const float v = Elem<T>::load(xr, i);
      part[j] += v * v;
    }
    const float ss = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
    const float inv = 1.0f / std::sqrt(ss / float(d) + eps);
    for (int64_t k = 0; k < d; ++k)
      Elem<T>::store(y + r * d, k, Elem<T>::load(w, k) * Elem<T>::round(Elem<T>::load(xr, k) * inv));
  }
}

// ---- rotary embedding, rotate-half layout, in place on [B, T, H, D] ----

// x[h] (h < D/2) -> x[h] * cos[h] - x[h + D/2] * sin[h]; x[h + D/2] -> x[h + D/2] * cos + x[h] * sin,
// each product and the sum rounded to T (torch: x * cos + cat(-x2, x1) * sin).  The first d channels of
// heads ld apart (ld > d: partial rotary, the rest passed through).
template <class T>
void rope_rows(T* x, const T* cos, const T* sin, int64_t heads, int64_t d, int64_t ld, int64_t t0, int64_t t1) {
  const int64_t half = d / 2;
  for (int64_t t = t0; t < t1; ++t) {  // t: flat (batch, position) index
    const T* c = cos + t * d;
    const T* s = sin + t * d;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + (t * heads + h) * ld;
      for (int64_t i = 0; i < half; ++i) {
        const float a = Elem<T>::load(v, i), b = Elem<T>::load(v, i + half);
        const float lo = Elem<T>::round(a * Elem<T>::load(c, i)) + Elem<T>::round(-b * Elem<T>::load(s, i));
        const float hi = Elem<T>::round(b * Elem<T>::load(c, i + half)) + Elem<T>::round(a * Elem<T>::load(s, i + half));
        Elem<T>::store(v, i, lo);
        Elem<T>::store(v, i + half, hi);
      }
    }
  }
}

// ---- SiLU and multiply: y = dtype(silu(g)) * u, rounded ----

template <class T>
void silu_mul_range(const T* g, const T* u, T* y, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const float v = Elem<T>::load(g, i);
    const float s = Elem<T>::round(v / (1.0f + std::exp(-v)));
    Elem<T>::store(y, i, s * Elem<T>::load(u, i));
  }
}

// ---- sigmoid: y = dtype(1 / (1 + exp(-x))) (gated attention's output gate, a shared expert's gate) ----

template <class T>
void sigmoid_range(const T* x, T* y, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) Elem<T>::store(y, i, 1.0f / (1.0f + std::exp(-Elem<T>::load(x, i))));
}

// ---- gelu (tanh approximation) and multiply: y = dtype(gelu_tanh(g)) * u, rounded ----
// gelu_tanh(v) = 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))), torch's scalar spelling (Gemma's MLP), its
// tanh vmath.h's (within 2 ulp of libm's; the loop vectorises)

template <class T>
void gelu_tanh_mul_range(const T* g, const T* u, T* y, int64_t i0, int64_t i1) {
  const float beta = float(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
  for (int64_t i = i0; i < i1; ++i) {
    const float v = Elem<T>::load(g, i);
    const float inner = beta * (v + kappa * (v * v * v));
    const float a = Elem<T>::round(0.5f * v * (1.0f + tanh_vec(inner)));
    Elem<T>::store(y, i, a * Elem<T>::load(u, i));
  }
}

// ---- clamped SwiGLU (gpt-oss's experts): y = (clamp(u, -L, L) + 1) * (g' * sigmoid(alpha g')), g' = min(g, L) ----
// float32 only (the expert group's); NaN passes through the clamps as torch's clamp passes it.

void swiglu_clamped_range(const float* g, const float* u, float* y, float alpha, float limit, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const float gc = g[i] > limit ? limit : g[i];
    const float uc = u[i] > limit ? limit : (u[i] < -limit ? -limit : u[i]);
    const float s = 1.0f / (1.0f + std::exp(-(gc * alpha)));
    y[i] = (uc + 1.0f) * (gc * s);
  }
}

template <class F>
void dispatch(at::ScalarType t, const F& f) {
  switch (t) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(at::BFloat16{});
    default: return f(at::Half{});
  }
}

}  // namespace

void rms_norm_f32(const float* x, const float* w, float* y, int64_t d, float eps, int64_t r0, int64_t r1) {
  rms_norm_rows(x, w, y, d, eps, r0, r1);
}

void rope_f32(float* x, const float* cos, const float* sin, int64_t heads, int64_t d, int64_t t0, int64_t t1) {
  rope_rows(x, cos, sin, heads, d, d, t0, t1);
}

void rope_f32(float* x, const float* cos, const float* sin, int64_t heads, int64_t d, int64_t ld, int64_t t0,
              int64_t t1) {
  rope_rows(x, cos, sin, heads, d, ld, t0, t1);
}

void sigmoid_f32(const float* x, float* y, int64_t i0, int64_t i1) { sigmoid_range(x, y, i0, i1); }

void silu_mul_f32(const float* g, const float* u, float* y, int64_t i0, int64_t i1) {
  silu_mul_range(g, u, y, i0, i1);
}

void gelu_tanh_mul_f32(const float* g, const float* u, float* y, int64_t i0, int64_t i1) {
  gelu_tanh_mul_range(g, u, y, i0, i1);
}

void swiglu_clamped_f32(const float* g, const float* u, float* y, float alpha, float limit, int64_t i0, int64_t i1) {
  swiglu_clamped_range(g, u, y, alpha, limit, i0, i1);
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  check_float(x_in, "rms_norm", "x");
  check_float(w_in, "rms_norm", "weight");
  same_dtype(x_in, w_in, "rms_norm", "weight");
  const int64_t d = x_in.dim() ? x_in.size(-1) : 0;
  if (x_in.dim() < 1 || w_in.dim() != 1 || w_in.size(0) != d) {
    std::ostringstream s;
    s << "rms_norm: weight " << w_in.sizes() << " does not match the last dimension of x " << x_in.sizes();
    bad(s.str());
  }
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t n = d ? x.numel() / d : 0;
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    rows(n, d, [&](int64_t r0, int64_t r1) { rms_norm_rows(xp, wp, yp, d, float(eps), r0, r1); });
  });
  return y;
}

void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_float(x, "rope", "x");
  same_dtype(x, cos, "rope", "cos");
  same_dtype(x, sin, "rope", "sin");
  // x [B, T, H, D] contiguous; cos, sin [B, T, D] contiguous (B may be 1 for all rows of x)
  const bool ok = x.dim() == 4 && x.is_contiguous() && x.size(3) % 2 == 0 && cos.dim() == 3 &&
                  cos.is_contiguous() && sin.sizes() == cos.sizes() && sin.is_contiguous() &&
                  cos.size(0) == x.size(0) && cos.size(1) == x.size(1) && cos.size(2) == x.size(3);
  if (!ok) {
    std::ostringstream s;
    s << "rope: expected contiguous x [B, T, H, D] (D even) and cos, sin [B, T, D]; found x " << x.sizes()
      << ", cos " << cos.sizes() << ", sin " << sin.sizes();
    bad(s.str());
  }
  const int64_t bt = x.size(0) * x.size(1), heads = x.size(2), d = x.size(3);
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    T* xp = x.data_ptr<T>();
    const T* c = cos.data_ptr<T>();
    const T* s = sin.data_ptr<T>();
    rows(bt, heads * d, [&](int64_t t0, int64_t t1) { rope_rows(xp, c, s, heads, d, d, t0, t1); });
  });
}

namespace {

// y = act(gate) * up element-wise, gate and up of one shape; `range` one of the *_mul_range templates
template <template <class> class Range>
at::Tensor gated_act(const at::Tensor& g_in, const at::Tensor& u_in, const char* op) {
  check_float(g_in, op, "gate");
  same_dtype(g_in, u_in, op, "up");
  if (g_in.sizes() != u_in.sizes()) {
    std::ostringstream s;
    s << op << ": gate " << g_in.sizes() << " and up " << u_in.sizes() << " differ in shape";
    bad(s.str());
  }
  const at::Tensor g = g_in.contiguous(), u = u_in.contiguous();
  at::Tensor y = at::empty_like(g);
  dispatch(g.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* gp = g.data_ptr<T>();
    const T* up = u.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    rows(g.numel(), 1, [&](int64_t i0, int64_t i1) { Range<T>::run(gp, up, yp, i0, i1); });
  });
  return y;
}

template <class T>
struct SiluRange {
  static void run(const T* g, const T* u, T* y, int64_t i0, int64_t i1) { silu_mul_range(g, u, y, i0, i1); }
};
template <class T>
struct GeluTanhRange {
  static void run(const T* g, const T* u, T* y, int64_t i0, int64_t i1) { gelu_tanh_mul_range(g, u, y, i0, i1); }
};

}  // namespace

at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u) { return gated_act<SiluRange>(g, u, "silu_mul"); }

at::Tensor gelu_tanh_mul(const at::Tensor& g, const at::Tensor& u) {
  return gated_act<GeluTanhRange>(g, u, "gelu_tanh_mul");
}

at::Tensor sigmoid(const at::Tensor& x_in) {
  check_float(x_in, "sigmoid", "x");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x);
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    rows(x.numel(), 1, [&](int64_t i0, int64_t i1) { sigmoid_range(xp, yp, i0, i1); });
  });
  return y;
}

void register_ops(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("rope_", &rope_, py::arg("x"), py::arg("cos"), py::arg("sin"), py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, py::arg("gate"), py::arg("up"), py::call_guard<py::gil_scoped_release>());
  m.def("sigmoid", &sigmoid, py::arg("x"), py::call_guard<py::gil_scoped_release>());
  m.def("gelu_tanh_mul", &gelu_tanh_mul, py::arg("gate"), py::arg("up"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace quill
