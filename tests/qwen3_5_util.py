"""Tiny random Qwen3.5 models (dense and MoE) made with transformers: the tests' and the fixture tools' one
definition (no pytest or quill imports: tests/tools/make_qwen3_5_ct.py runs it in llm-compressor's env)."""

from __future__ import annotations

import torch

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=24, linear_key_head_dim=20, linear_value_head_dim=24,
              linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=3)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=40)


def hf_qwen3_5(moe: bool, seed: int = 0, **overrides):
    import transformers as t
    if moe:
        hf = t.Qwen3_5MoeForCausalLM(t.Qwen3_5MoeTextConfig(**{**COMMON, **MOE, **overrides}))
    else:
        hf = t.Qwen3_5ForCausalLM(t.Qwen3_5TextConfig(**{**COMMON, **overrides}))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.5)  # decays from fast to slow
            elif name.endswith("dt_bias"):
                p.normal_(0, 1)
            elif p.dim() >= 2:
                p.normal_(0, 0.3 if name.endswith("mlp.gate.weight") else 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.1)  # zero-centred norms away from 0, the gated norm from 1
    return hf.eval()
