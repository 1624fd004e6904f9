// The Gated DeltaNet decode template (deltanet_tile.h) compiled for avx2.
#define DN_W 8
#include "deltanet_tile.h"

namespace quill {

DnConv dn_conv_avx2() { return dnet::conv; }
DnHead dn_head_avx2() { return dnet::head; }

}  // namespace quill
