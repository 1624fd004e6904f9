"""Tiny random MoE models: transformers twins and the mapping between their fused experts and per-expert names.

transformers 5 keeps a layer's experts fused in memory (``mlp.experts.gate_up_proj``
[E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) and writes them per expert on
``save_pretrained``; checkpoints (and quill) name them per expert.
"""

from __future__ import annotations

import re

import torch

from tests.model_util import BASE

MOE_EXTRA = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, tie_word_embeddings=False),
    # layer 1 dense (mlp_only_layers), 0 and 2 sparse; routed weights not renormalized
    "qwen2_moe": dict(num_hidden_layers=3, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1],
                      tie_word_embeddings=False),
    # decoder_sparse_step 2: layers 1 and 3 sparse, 0 and 2 dense; renormalized
    "qwen3_moe": dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, decoder_sparse_step=2, head_dim=32, tie_word_embeddings=True),
}
MOE_ARCHS = sorted(MOE_EXTRA)


def hf_moe_model(model_type: str, seed: int = 0, **overrides):
    """A random float32 transformers MoE model (eager attention), weights far from their init."""
    import transformers
    classes = {"mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
               "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
               "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}
    cfg_cls, model_cls = classes[model_type]
    cfg = cfg_cls(**{**BASE, **MOE_EXTRA[model_type], **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                # routers a little sharper than the rest, so top-k choices are far from ties
                p.normal_(0, 0.3 if name.endswith("mlp.gate.weight") else 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.05)
    return model


_FUSED = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)")
_SPLIT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 fused expert parameters -> one ``experts.<e>.<proj>.weight`` per expert."""
    out = {}
    for k, v in state.items():
        m = _FUSED.fullmatch(k)
        if m is None:
            out[k] = v
            continue
        prefix, which = m.groups()
        for e in range(v.shape[0]):
            if which == "gate_up_proj":
                inter = v.shape[1] // 2
                out[f"{prefix}.{e}.gate_proj.weight"] = v[e, :inter].clone()
                out[f"{prefix}.{e}.up_proj.weight"] = v[e, inter:].clone()
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = v[e].clone()
    return out


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`split_experts` (what ``load_state_dict`` of a transformers 5 model wants)."""
    out, experts = {}, {}
    for k, v in state.items():
        m = _SPLIT.fullmatch(k)
        if m is None:
            out[k] = v
        else:
            prefix, e, proj = m.groups()
            experts.setdefault(prefix, {}).setdefault(int(e), {})[proj] = v.float()
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]]) for e in ids])
        out[f"{prefix}.down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in ids])
    return out
