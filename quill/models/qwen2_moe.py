"""Qwen2-MoE (HF ``model_type`` qwen2_moe, e.g. Qwen1.5-MoE): the Qwen2 decoder with sparse expert layers.

Sparse layers (the Qwen-MoE rule, see :mod:`quill.models.qwen3_moe`) add to the
routed experts a ``shared_expert`` MLP that every token runs, scaled by
``sigmoid(shared_expert_gate(x))``.  q/k/v carry biases when ``qkv_bias``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from quill.layers import SharedExpertMoeBlock, check_moe_config, expert_count, is_sparse_layer
from quill.models import llama, qwen2


@dataclass
class ModelArgs(qwen2.ModelArgs):
    # transformers' defaults where a config omits a field
    num_experts: int | None = None  # also spelt num_local_experts (transformers 5)
    num_local_experts: int | None = None
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list | None = None
    qkv_bias: bool = True

    def __post_init__(self):
        super().__post_init__()
        self.num_experts = expert_count(self.model_type, self.num_experts, self.num_local_experts, 60)
        self.num_local_experts = self.num_experts
        self.mlp_only_layers = list(self.mlp_only_layers or [])
        check_moe_config(self.model_type, self.num_hidden_layers, self.num_experts, self.num_experts_per_tok,
                         self.moe_intermediate_size, self.decoder_sparse_step, self.mlp_only_layers)
        self.check_positive("shared_expert_intermediate_size")

    def is_sparse(self, layer: int) -> bool:
        return is_sparse_layer(layer, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers)

    def layer_window(self, layer: int) -> int | None:
        """transformers' Qwen2-MoE default when ``layer_types`` is absent: even layers below
        ``max_window_layers`` are local (with ``use_sliding_window``)."""
        if self.layer_types is None and self.use_sliding_window and self.sliding_window:
            cutoff = self.max_window_layers if self.max_window_layers is not None else 28
            return self.sliding_window if layer % 2 == 0 and layer < cutoff else None
        return super().layer_window(layer)


class Model(qwen2.Model):
    def make_attention(self, args: ModelArgs) -> nn.Module:
        return self.Attention(args, args.qkv_bias, False)

    def make_mlp(self, args: ModelArgs, layer: int) -> nn.Module:
        if not args.is_sparse(layer):
            return llama.MLP(args)
        shared = llama.MLP(dataclasses.replace(args, intermediate_size=args.shared_expert_intermediate_size))
        return SharedExpertMoeBlock(f"model.layers.{layer}.mlp", shared, args.hidden_size,
                                    intermediate=args.moe_intermediate_size, num_experts=args.num_experts,
                                    top_k=args.num_experts_per_tok, renormalize=args.norm_topk_prob,
                                    hidden_act=args.hidden_act, round_weights=True)
