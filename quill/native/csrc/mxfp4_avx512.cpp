// The MXFP4 kernels in the AVX-512 variant: the AVX2 code (mxfp4_v256.h), compiled with the
// variant's flags.  No AVX-512 instructions of its own: none could be run here (a Zen 3 host).
#include "mxfp4_v256.h"

namespace quill {

const Mxfp4Kernels& mxfp4_avx512() { return mx::kernels<V256x2>(); }

}  // namespace quill
