// The decode-attention template (attention_tile.h) compiled for scalar (baseline x86-64: the twin every variant must match).
#include "attention_tile.h"

namespace quill {

AttnHead attn_head_scalar() { return attn::any_head; }

}  // namespace quill
