// The extension module: the quantized linear (linear.cpp), the fused ops, dense linear,
// attention and decode step (registered from their files), and the free functions tests and
// benchmarks call (activation quantizers alone, huge-page copies, a bandwidth probe).
// Precondition failures throw KernelFailure / OpFailure / IsaFailure, raised in Python as
// quill.errors.KernelError.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common.h"
#include "hugepage.h"
#include "linear.h"
#include "ops.h"

namespace quill {
void register_deltanet(pybind11::module_& m);  // deltanet.cpp: deltanet_decode
void register_mxfp4(pybind11::module_& m);     // mxfp4.cpp: NativeMxfp4
namespace {

// Exposed for tests: the activation quantizer alone, x [M, K] -> (q [M, Kp], qsum [M, S], scale [M], zero [M],
// and with per_segment gscale [M, S]).
std::vector<at::Tensor> quantize_activations(const at::Tensor& x, at::Tensor seg_end, int64_t chunk,
                                             std::optional<at::Tensor> src, bool dynamic, bool symmetric,
                                             double scale, double zero, const std::string& isa, bool per_segment) {
  if (x.dim() != 2 || !x.is_contiguous()) fail("quantize_activations: x should be contiguous [M, K], found ", shape_of(x));
  const int64_t m = x.size(0), k = x.size(1), nseg = seg_end.numel();
  expect(seg_end, at::kInt, {nseg}, "seg_end");
  if (nseg == 0) fail("quantize_activations: no segments");
  const int64_t kp = int64_t(seg_end.data_ptr<int32_t>()[nseg - 1]) * chunk;
  if (src) expect(*src, at::kLong, {kp}, "src");
  else if (kp < k) fail("quantize_activations: ", kp, " stream positions cannot hold ", k, " columns");
  at::Tensor q = at::empty({m, kp}, x.options().dtype(at::kChar));
  at::Tensor qsum = at::empty({m, nseg}, x.options().dtype(at::kInt));
  at::Tensor sc = at::empty({m}, x.options().dtype(at::kFloat)), zp = at::empty({m}, x.options().dtype(at::kFloat));
  RawX in{x.data_ptr(), dtype_of(x.scalar_type(), "x"), k, src ? src->data_ptr<int64_t>() : nullptr, kp,
          seg_end.data_ptr<int32_t>(), int32_t(nseg), int32_t(chunk)};
  ActQuant aq{dynamic, symmetric, float(scale), float(zero), per_segment};
  if (per_segment && !(dynamic && symmetric)) fail("quantize_activations: per_segment needs dynamic symmetric");
  at::Tensor gs = at::empty({per_segment ? m : 0, nseg}, x.options().dtype(at::kFloat));
  table_for(isa).quantize(in, aq, q.data_ptr<int8_t>(), qsum.data_ptr<int32_t>(), sc.data_ptr<float>(),
                          zp.data_ptr<float>(), per_segment ? gs.data_ptr<float>() : nullptr, 0, int(m));
  if (!per_segment) return {q, qsum, sc, zp};
  return {q, qsum, sc, zp, gs};
}

// Exposed for tests: the split image of float activations alone (identity order or `src`
// gathered), x [M, K] -> (stream int8 [M, parts * Kp], qsum int32 [M, S, 2], scale float32 [M, S]);
// image_bits 24 (3 parts) or 16 (2 parts).
std::vector<at::Tensor> split_activations(const at::Tensor& x, at::Tensor seg_end, int64_t chunk,
                                          std::optional<at::Tensor> src, const std::string& isa, int64_t image_bits) {
  if (x.dim() != 2 || !x.is_contiguous()) fail("split_activations: x should be contiguous [M, K], found ", shape_of(x));
  const int64_t m = x.size(0), k = x.size(1), nseg = seg_end.numel();
  expect(seg_end, at::kInt, {nseg}, "seg_end");
  if (nseg == 0) fail("split_activations: no segments");
  if (image_bits != 24 && image_bits != 16)
    fail("split_activations: image_bits ", image_bits, " is not supported; supported: 24, 16");
  const int parts = image_bits == 24 ? SPLIT_PARTS : 2;
  for (int64_t s = 0, p0 = 0; s < nseg; p0 = seg_end.data_ptr<int32_t>()[s++] * chunk) {
    const int64_t p1 = int64_t(seg_end.data_ptr<int32_t>()[s]) * chunk;
    if (p1 <= p0 || p1 - p0 > SPLIT_MAX_SEGMENT)
      fail("split_activations: segment ", s, " holds ", p1 - p0, " positions; expected 1 to ", SPLIT_MAX_SEGMENT);
  }
  const int64_t kp = int64_t(seg_end.data_ptr<int32_t>()[nseg - 1]) * chunk;
  if (src) expect(*src, at::kLong, {kp}, "src");
  else if (kp < k) fail("split_activations: ", kp, " stream positions cannot hold ", k, " columns");
  at::Tensor xs = at::empty({m, parts * kp}, x.options().dtype(at::kChar));
  at::Tensor qsum = at::empty({m, nseg, 2}, x.options().dtype(at::kInt));
  at::Tensor sc = at::empty({m, nseg}, x.options().dtype(at::kFloat));
  RawX in{x.data_ptr(), dtype_of(x.scalar_type(), "x"), k, src ? src->data_ptr<int64_t>() : nullptr, kp,
          seg_end.data_ptr<int32_t>(), int32_t(nseg), int32_t(chunk), parts};
  std::vector<float> gathered;
  if (src) {
    gathered.resize(size_t(m * kp));
    gather_stream(in, gathered.data(), 0, int(m));
    in.x = gathered.data();
    in.dtype = DType::F32;
    in.k = kp;
    in.src = nullptr;
  }
  table_for(isa).quantize_split(in, xs.data_ptr<int8_t>(), qsum.data_ptr<int32_t>(), sc.data_ptr<float>(), 0, int(m));
  return {xs, qsum, sc};
}

// A contiguous copy of `t` (any strides: a permuted view is gathered straight into place,
// with no intermediate) on 2 MiB pages (hugepage.cpp); `t.contiguous()` if no memory
// could be mapped.
at::Tensor huge_page_copy(const at::Tensor& t) {
  if (t.device().is_cuda() || t.numel() == 0) return t.contiguous();
  HugeBlock blk = huge_alloc(size_t(t.numel()) * t.element_size());
  if (!blk.ptr) return t.contiguous();
  at::Tensor out = at::from_blob(blk.ptr, t.sizes(), [owner = blk.owner](void*) mutable { owner.reset(); },
                                 t.options().memory_format(at::MemoryFormat::Contiguous));
  out.copy_(t);
  return out;
}

// Streaming read of `buf` by `threads` threads of torch's pool (a bandwidth probe for
// benchmarks): XOR of every 64-bit word, so no byte can be skipped, with the kernels'
// software prefetch distance so the probe is not slower than they are.
int64_t stream_read(const at::Tensor& buf, int64_t threads) {
  if (!buf.is_contiguous() || buf.scalar_type() != at::kLong)
    fail("stream_read: buffer should be a contiguous int64 tensor, found ", shape_of(buf));
  const int64_t n = buf.numel() / 8 * 8;
  const uint64_t* p = reinterpret_cast<const uint64_t*>(buf.data_ptr<int64_t>());
  const int parts = int(std::max<int64_t>(1, std::min<int64_t>(threads, at::get_num_threads())));
  std::vector<uint64_t> acc(size_t(parts) * 8, 0);
  auto body = [&](int64_t t) {
    const int64_t b = n * t / parts / 8 * 8, e = n * (t + 1) / parts / 8 * 8;
    uint64_t a[8] = {};
    for (int64_t i = b; i < e; i += 8) {
      __builtin_prefetch(p + i + 256);  // 2 KiB ahead, as the kernels do
      for (int j = 0; j < 8; ++j) a[j] ^= p[i + j];
    }
    for (int j = 0; j < 8; ++j) acc[t * 8 + j] = a[j];
  };
  if (parts == 1) body(0);
  else at::parallel_for(0, parts, 1, [&](int64_t b, int64_t e) { for (int64_t t = b; t < e; ++t) body(t); });
  uint64_t r = 0;
  for (uint64_t v : acc) r ^= v;
  return int64_t(r);
}

}  // namespace
}  // namespace quill

PYBIND11_MODULE(_quill_native, m) {
  namespace py = pybind11;
  static PyObject* kernel_error = [] {
    py::object cls = py::module_::import("quill.errors").attr("KernelError");
    return cls.release().ptr();  // kept for the life of the process
  }();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const quill::KernelFailure& e) {
      PyErr_SetString(kernel_error, e.what());
    } catch (const quill::OpFailure& e) {
      PyErr_SetString(kernel_error, e.what());
    } catch (const quill::IsaFailure& e) {
      PyErr_SetString(kernel_error, e.what());
    }
  });
  m.doc() = "quill native CPU linear kernels (W4A16, W8A16, W4A8, W8A8)";
  quill::register_linear(m);
  // at::parallel_for only forks when this TU is compiled with OpenMP (see build.py)
  m.def("parallel_backend_compiled", [] {
#ifdef _OPENMP
    return true;
#else
    return false;
#endif
  });
  // the ISA variants this build holds, best first (quill info lists them)
  m.def("isa_backends", &quill::built_isas);
  m.def("split_activations", &quill::split_activations, py::arg("x"), py::arg("seg_end"), py::arg("chunk"),
        py::arg("src"), py::arg("isa"), py::arg("image_bits") = 24);
  quill::register_ops(m);
  quill::register_dense(m);
  quill::register_attention(m);
  quill::register_step(m);
  quill::register_moe(m);
  quill::register_deltanet(m);
  quill::register_mxfp4(m);
  m.def("huge_page_copy", &quill::huge_page_copy, py::arg("t"));
  m.def("stream_read", &quill::stream_read, py::arg("buf"), py::arg("threads"));
  m.def("quantize_activations", &quill::quantize_activations, py::arg("x"), py::arg("seg_end"), py::arg("chunk"),
        py::arg("src"), py::arg("dynamic"), py::arg("symmetric"), py::arg("scale"), py::arg("zero"), py::arg("isa"),
        py::arg("per_segment") = false);
}
