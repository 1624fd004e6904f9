// The MXFP4 kernels (mxfp4_tile.h) on AVX2 + FMA.
#include "mxfp4_v256.h"

namespace quill {

const Mxfp4Kernels& mxfp4_avx2() { return mx::kernels<V256x2>(); }

}  // namespace quill
