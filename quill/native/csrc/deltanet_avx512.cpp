// The Gated DeltaNet decode template (deltanet_tile.h) compiled for avx512.
#define DN_W 16
#include "deltanet_tile.h"

namespace quill {

DnConv dn_conv_avx512() { return dnet::conv; }
DnHead dn_head_avx512() { return dnet::head; }

}  // namespace quill
