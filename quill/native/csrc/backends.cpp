// The ISA backend table (isa.h), filled with the variants this build compiled: build.py passes
// -DQUILL_BUILT_AVX512 / -DQUILL_BUILT_AVX2 for the ones this CPU runs, and only their functions
// are referenced (the scalar twins always are).  Plain C++, no torch headers.
#include <array>
#include <string>
#include <vector>

#include "isa.h"

namespace quill {
namespace {

struct Variant {
  IsaBackend backend;
  bool (*runs)();     // this CPU has every flag the variant needs
  const char* needs;  // those flags, for the refusal
};

bool runs_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
bool runs_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool runs_scalar() { return true; }

// Every variant quill knows, best first; a variant not built has null entries.
std::array<Variant, 3> known() {
  return {{
#ifdef QUILL_BUILT_AVX512
      {{"avx512", &table_avx512(), dense_gemm_avx512(), attn_head_avx512(), kv_store_avx512(), prefill_block_avx512(),
        dn_conv_avx512(), dn_head_avx512(), &mxfp4_avx512()},
       runs_avx512, "AVX512F/BW/VL and AVX512-VNNI"},
#else
      {{"avx512", nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr}, runs_avx512, "AVX512F/BW/VL and AVX512-VNNI"},
#endif
#ifdef QUILL_BUILT_AVX2
      {{"avx2", &table_avx2(), dense_gemm_avx2(), attn_head_avx2(), kv_store_avx2(), prefill_block_avx2(),
        dn_conv_avx2(), dn_head_avx2(), &mxfp4_avx2()},
       runs_avx2, "AVX2, FMA and F16C"},
#else
      {{"avx2", nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr}, runs_avx2, "AVX2, FMA and F16C"},
#endif
      {{"scalar", &table_scalar(), dense_gemm_scalar(), attn_head_scalar(), kv_store_scalar(), prefill_block_scalar(),
        dn_conv_scalar(), dn_head_scalar(), &mxfp4_scalar()},
       runs_scalar, ""},
  }};
}

const std::array<Variant, 3>& variants() {
  static const std::array<Variant, 3> v = [] {
    __builtin_cpu_init();
    return known();
  }();
  return v;
}

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

}  // namespace

std::vector<std::string> built_isas() {
  std::vector<std::string> out;
  for (const Variant& v : variants())
    if (v.backend.linear) out.emplace_back(v.backend.name);
  return out;
}

const IsaBackend& backend_for(const std::string& isa, const char* entry) {
  for (const Variant& v : variants()) {
    if (isa != v.backend.name) continue;
    if (!v.runs())
      throw IsaFailure(std::string(entry) + ": ISA '" + isa + "' needs " + v.needs + ", which this CPU lacks");
    if (!v.backend.linear)
      throw IsaFailure(std::string(entry) + ": ISA '" + isa + "' is not built into this extension (built: " +
                       joined(built_isas()) + "); rebuild on this CPU: python -m quill.native.build");
    return v.backend;
  }
  throw IsaFailure(std::string(entry) + ": unknown ISA '" + isa + "'; supported: avx512, avx2, scalar");
}

}  // namespace quill
