// The extension's one CPU check.  Python decides the ISA once, at load, from the Platform
// (quill.native.isa_for: "avx512", "avx2" or "scalar") and hands that name to every native
// entry (linear, dense, attention); each entry verifies it here before taking a code path,
// so a wrong choice is an error and never an illegal instruction.  The flags are the same
// sets quill.native.ISAS requires.
#pragma once

#include <string>

namespace quill {

// "" when this CPU can run `isa`, else why not (names the ISA and what it needs).
inline std::string isa_problem(const std::string& isa) {
  __builtin_cpu_init();
  if (isa == "scalar") return "";
  if (isa == "avx2") {
    const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    return ok ? "" : "ISA 'avx2' needs AVX2, FMA and F16C, which this CPU lacks";
  }
  if (isa == "avx512") {
    const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return ok ? "" : "ISA 'avx512' needs AVX512F/BW/VL and AVX512-VNNI, which this CPU lacks";
  }
  return "unknown ISA '" + isa + "'; supported: avx512, avx2, scalar";
}

}  // namespace quill
