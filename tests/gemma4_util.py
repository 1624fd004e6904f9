"""Tiny random Gemma 4 text models made with transformers: the tests' and the fixture tools' one definition
(no pytest or quill imports: tests/tools/make_windowed_ct.py runs it in llm-compressor's env)."""

from __future__ import annotations

import torch

WINDOW = 16
L, G = "sliding_attention", "full_attention"
# odd sizes; layers 4 and 5 KV-shared (reading layers 2 and 3), global heads 24 wide with one KV head
TEXT = dict(vocab_size=320, hidden_size=72, intermediate_size=100, num_hidden_layers=6, num_attention_heads=6,
            num_key_value_heads=2, head_dim=16, global_head_dim=24, num_global_key_value_heads=1,
            attention_k_eq_v=True, max_position_embeddings=256, sliding_window=WINDOW,
            final_logit_softcapping=30.0, layer_types=[L, G] * 3, num_kv_shared_layers=2, use_double_wide_mlp=True,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=320,
            rope_parameters={G: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 50000.0},
                             L: {"rope_type": "default", "rope_theta": 1000.0}})


def randomized(model):
    """``model`` with larger bfloat16-valued weights (far from uniform logits) and norms and layer scalars
    away from their 1 init, so they are exercised."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.1)
            p.copy_(p.bfloat16().float())
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand(1) + 0.5)
    return model.eval()


def hf_gemma4(seed: int = 0, **overrides):
    import transformers
    cfg = transformers.Gemma4TextConfig(**{**TEXT, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomized(transformers.Gemma4ForCausalLM(cfg))
