"""Qwen3 (HF ``model_type`` qwen3): the Llama decoder with per-head RMSNorm on q and k.

``head_dim`` is its own config field (e.g. 128 with hidden 1024 and 16 heads),
independent of hidden_size / num_attention_heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from quill.layers import AttentionSpec, RMSNorm
from quill.models import llama, qwen2


@dataclass
class ModelArgs(qwen2.ModelArgs):
    pass  # Qwen2's window convention (use_sliding_window, layer_types, max_window_layers)


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, qkv_bias: bool, o_bias: bool):
        super().__init__(args, qkv_bias, o_bias)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(x)  # [B, T, H, D]: the norms act on each head's D channels
        return self.q_norm(q), self.k_norm(k), v

    def spec(self) -> AttentionSpec:
        return dataclasses.replace(super().spec(), q_norm=self.q_norm, k_norm=self.k_norm)


class Model(llama.Model):
    Attention = Attention
