"""Tiny random Gemma 3 text models made with transformers: the tests' and the fixture tools' one definition
(no pytest or quill imports: tests/tools/make_windowed_ct.py runs it in llm-compressor's env)."""

from __future__ import annotations

import torch

WINDOW = 16
# odd sizes; layers 0 and 2 local, 1 and 3 global; their own rope bases, linear scaling on the global ones
TEXT = dict(vocab_size=320, hidden_size=72, intermediate_size=100, num_hidden_layers=4, num_attention_heads=6,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=WINDOW,
            query_pre_attn_scalar=20, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})


def randomized(model):
    """``model`` with larger bfloat16-valued weights (far from uniform logits; what the native dense kernels
    hold) and norms away from their 0 init, so the (1 + w) offsets are exercised."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.1)
            p.copy_(p.bfloat16().float())
    return model.eval()


def hf_gemma3(seed: int = 0, **overrides):
    import transformers
    cfg = transformers.Gemma3TextConfig(**{**TEXT, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomized(transformers.Gemma3ForCausalLM(cfg))
