"""Mixtral (HF ``model_type`` mixtral): the Llama decoder whose MLP is a sparse mixture of experts.

Checkpoint names: ``block_sparse_moe.gate`` (router) and
``block_sparse_moe.experts.<e>.w1 / w3 / w2`` (gate / up / down).  Tools that
linearise transformers 5's fused experts (llm-compressor) and GGUF files write
``gate_proj / up_proj / down_proj`` instead; both spellings load.  Routing is
softmax, top-k, always renormalized.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from quill.layers import SparseMoeBlock, check_moe_config, expert_count
from quill.models import llama

EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down


@dataclass
class ModelArgs(llama.ModelArgs):
    # transformers' defaults where a config omits a field
    num_local_experts: int | None = None  # also spelt num_experts
    num_experts: int | None = None
    num_experts_per_tok: int = 2
    router_jitter_noise: float = 0.0  # training only

    def __post_init__(self):
        super().__post_init__()
        self.num_local_experts = expert_count(self.model_type, self.num_experts, self.num_local_experts, 8)
        self.num_experts = self.num_local_experts
        check_moe_config(self.model_type, self.num_hidden_layers, self.num_local_experts, self.num_experts_per_tok,
                         self.intermediate_size)


class DecoderLayer(llama.DecoderLayer):
    """The Llama layer with its feed-forward block under Mixtral's name."""

    def __init__(self, args: ModelArgs, attention: nn.Module, moe: nn.Module):
        super().__init__(args, attention, None)
        self.block_sparse_moe = moe

    def feed_forward(self) -> nn.Module:
        return self.block_sparse_moe

    def forward(self, x, rope, mask, cache):
        h = x + self.self_attn(self.input_layernorm(x), rope, mask, cache)
        return h + self.block_sparse_moe(self.post_attention_layernorm(h))


class Model(llama.Model):
    checkpoint_aliases = (
        (r"^(model\.layers\.\d+)\.mlp\.", r"\1.block_sparse_moe."),  # transformers 5's in-memory name
        (r"(\.experts\.\d+)\.gate_proj(?=\.|$)", r"\1.w1"),
        (r"(\.experts\.\d+)\.up_proj(?=\.|$)", r"\1.w3"),
        (r"(\.experts\.\d+)\.down_proj(?=\.|$)", r"\1.w2"),
    )

    def make_layer(self, args: ModelArgs, layer: int) -> nn.Module:
        moe = SparseMoeBlock(f"model.layers.{layer}.block_sparse_moe", args.hidden_size,
                             intermediate=args.intermediate_size, num_experts=args.num_local_experts,
                             top_k=args.num_experts_per_tok, renormalize=True, hidden_act=args.hidden_act,
                             expert_names=EXPERT_NAMES)
        return DecoderLayer(args, self.make_attention(args), moe)

