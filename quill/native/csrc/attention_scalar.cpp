// The decode- and prefill-attention templates (attention_tile.h, prefill_tile.h) compiled for scalar (baseline x86-64: the twin every variant must match).
#include "attention_tile.h"
#include "prefill_tile.h"

namespace quill {

AttnHead attn_head_scalar() { return attn::any_head; }
PrefillBlock prefill_block_scalar() { return attn::prefill_block; }
KVStore kv_store_scalar() { return attn::store_kv; }

}  // namespace quill
