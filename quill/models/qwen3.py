"""Qwen3 (HF ``model_type`` qwen3): the Llama decoder with per-head RMSNorm on q and k.

``head_dim`` is its own config field (e.g. 128 with hidden 1024 and 16 heads),
independent of hidden_size / num_attention_heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from quill.layers import AttentionSpec, RMSNorm
from quill.models import llama
from quill.models.base import sliding_window_limit


@dataclass
class ModelArgs(llama.ModelArgs):
    use_sliding_window: bool = False
    max_window_layers: int | None = None
    layer_types: list | None = None

    @property
    def context_length(self) -> int:
        windowed = self.use_sliding_window or any(t != "full_attention" for t in self.layer_types or ())
        return sliding_window_limit(self.sliding_window, windowed, self.max_position_embeddings)


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
