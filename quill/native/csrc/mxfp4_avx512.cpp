// The MXFP4 kernels (mxfp4_tile.h) on AVX-512 F/BW + VNNI (mxfp4_v512.h: one zmm per 16 rows).
#include "mxfp4_v512.h"

namespace quill {

const Mxfp4Kernels& mxfp4_avx512() { return mx::kernels<V512>(); }

}  // namespace quill
