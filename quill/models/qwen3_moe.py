"""Qwen3-MoE (HF ``model_type`` qwen3_moe): the Qwen3 decoder with sparse expert layers.

A layer is sparse unless listed in ``mlp_only_layers``, every
``decoder_sparse_step``-th layer; sparse layers route each token to
``num_experts_per_tok`` of ``num_experts`` experts (softmax, top-k,
renormalized when ``norm_topk_prob``), dense ones run the usual MLP with
``intermediate_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from quill.layers import SparseMoeBlock, check_moe_config, expert_count, is_sparse_layer
from quill.models import llama, qwen3


@dataclass
class ModelArgs(qwen3.ModelArgs):
    # transformers' defaults where a config omits a field
    num_experts: int | None = None  # also spelt num_local_experts (transformers 5)
    num_local_experts: int | None = None
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list | None = None

    def layer_window(self, layer: int) -> int | None:
        """transformers' Qwen3-MoE: ``use_sliding_window`` puts the window on every layer."""
        return self.sliding_window if self.use_sliding_window else None

    def __post_init__(self):
        super().__post_init__()
        self.num_experts = expert_count(self.model_type, self.num_experts, self.num_local_experts, 128)
        self.num_local_experts = self.num_experts
        self.mlp_only_layers = list(self.mlp_only_layers or [])
        check_moe_config(self.model_type, self.num_hidden_layers, self.num_experts, self.num_experts_per_tok,
                         self.moe_intermediate_size, self.decoder_sparse_step, self.mlp_only_layers)

    def is_sparse(self, layer: int) -> bool:
        return is_sparse_layer(layer, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers)


def sparse_block(args: ModelArgs, layer: int) -> SparseMoeBlock:
    return SparseMoeBlock(f"model.layers.{layer}.mlp", args.hidden_size, intermediate=args.moe_intermediate_size,
                          num_experts=args.num_experts, top_k=args.num_experts_per_tok,
                          renormalize=args.norm_topk_prob, hidden_act=args.hidden_act, round_weights=True)


class Model(qwen3.Model):
    def make_mlp(self, args: ModelArgs, layer: int) -> nn.Module:
        return sparse_block(args, layer) if args.is_sparse(layer) else llama.MLP(args)
