"""Tiny random gpt-oss models made with transformers: the tests' and the fixture tools' one definition
(no pytest or quill imports: tests/tools/make_windowed_ct.py runs it in llm-compressor's env)."""

from __future__ import annotations

import torch

WINDOW = 16
ROPE = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0}
# odd sizes; layers 0 and 2 slide (window 16), 1 and 3 see everything; 4 experts, top-2
CONFIG = dict(vocab_size=320, hidden_size=72, intermediate_size=40, num_hidden_layers=4, num_attention_heads=6,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=WINDOW,
              num_local_experts=4, num_experts_per_tok=2, rope_parameters=ROPE)


def randomized(model):
    """``model`` with larger bfloat16-valued weights (far from uniform logits), biases and sinks away from 0 (the
    sinks large enough that ignoring them moves every log-probability well past the tolerance)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn_like(p) + 1.0)
            elif p.dim() >= 2:
                p.normal_(0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.2)
            p.copy_(p.bfloat16().float())
    return model.eval()


def hf_gpt_oss(seed: int = 0, **overrides):
    import transformers
    cfg = transformers.GptOssConfig(**{**CONFIG, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomized(transformers.GptOssForCausalLM(cfg))
