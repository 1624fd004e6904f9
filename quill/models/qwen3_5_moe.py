"""Qwen3.5-MoE (HF ``model_type`` qwen3_5_moe_text, and the text part of qwen3_5_moe): the Qwen3.5 hybrid
decoder (:mod:`quill.models.qwen3_5`) whose every feed-forward block is routed experts (softmax, top-k,
always renormalized) plus a shared expert scaled by ``sigmoid(shared_expert_gate(x))``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from quill.layers import SharedExpertMoeBlock, check_moe_config, expert_count
from quill.models import llama, qwen3_5


@dataclass
class ModelArgs(qwen3_5.ModelArgs):
    # transformers' defaults where a config omits a field
    num_experts: int | None = None
    num_local_experts: int | None = None
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512

    def __post_init__(self):
        super().__post_init__()
        self.num_experts = expert_count(self.model_type, self.num_experts, self.num_local_experts, 256)
        self.num_local_experts = self.num_experts
        check_moe_config(self.model_type, self.num_hidden_layers, self.num_experts, self.num_experts_per_tok,
                         self.moe_intermediate_size)
        self.check_positive("shared_expert_intermediate_size")


class Model(qwen3_5.Model):
    def make_mlp(self, args: ModelArgs, layer: int) -> nn.Module:
        shared = llama.MLP(dataclasses.replace(args, intermediate_size=args.shared_expert_intermediate_size))
        return SharedExpertMoeBlock(f"model.layers.{layer}.mlp", shared, args.hidden_size,
                                    intermediate=args.moe_intermediate_size, num_experts=args.num_experts,
                                    top_k=args.num_experts_per_tok, renormalize=True,
                                    hidden_act=args.hidden_act, round_weights=True)
