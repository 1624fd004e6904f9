// The decode- and prefill-attention templates (attention_tile.h, prefill_tile.h) compiled for avx512.
#define ATT_W 16
#include "attention_tile.h"
#define PF_VW 16
#define PF_QK_KEYS 4
#define PF_QK_VECS 4
#define PF_PV_ROWS 4
#define PF_PV_VECS 4
#include "prefill_tile.h"

namespace quill {

AttnHead attn_head_avx512() { return attn::any_head; }
PrefillBlock prefill_block_avx512() { return attn::prefill_block; }
KVStore kv_store_avx512() { return attn::store_kv; }

}  // namespace quill
