// The Gated DeltaNet decode template (deltanet_tile.h) compiled for scalar (baseline x86-64: the twin every variant must match).
#include "deltanet_tile.h"

namespace quill {

DnConv dn_conv_scalar() { return dnet::conv; }
DnHead dn_head_scalar() { return dnet::head; }

}  // namespace quill
