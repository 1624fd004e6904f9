// The decode-attention template (attention_tile.h) compiled for avx2.
#include "attention_tile.h"

namespace quill {

AttnHead attn_head_avx2() { return attn::any_head; }

}  // namespace quill
