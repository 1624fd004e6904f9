// The decode-attention template (attention_tile.h) compiled for avx512.
#include "attention_tile.h"

namespace quill {

AttnHead attn_head_avx512() { return attn::any_head; }

}  // namespace quill
