"""The building blocks model files wire together: slots the loader fills, norms, rotary embeddings.

Model files build their linear layers with :func:`linear` and their embedding
with :class:`Embedding`.  Both are *slots*: empty at construction, filled once
at load time with whatever the checkpoint holds for that module name: a
canonical ``QuantizedWeight`` (run through a kernel chosen by
``quill.kernels``) or a dense float tensor.  Model code never learns which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quill.errors import ModelError
from quill.kernels import fused
from quill.canonical import QuantizedWeight


class Linear(nn.Module):
    """A linear slot ``y = x @ W^T (+ b)``; ``impl`` is set by the loader (QuantLinear or DenseLinear)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bias
        self.impl: Any = None

    @property
    def filled(self) -> bool:
        return self.impl is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self.impl(x)

    def extra_repr(self) -> str:
        kind = "empty" if self.impl is None else self.impl.kernel_name
        return f"{self.in_features} -> {self.out_features}, bias={self.has_bias}, {kind}"


class PostLoad:
    """Mixin for modules that finish their own set-up once every slot is filled.

    The hook for blocks that regroup loaded layers, e.g. a mixture-of-experts
    block stacking its per-expert linears (``mlp.experts.<e>.gate_proj``, ...).
    """

    def post_load(self) -> None:
        raise NotImplementedError


def linear(in_features: int, out_features: int, bias: bool = False) -> Linear:
    """The layer factory every model uses for its projections."""
    return Linear(in_features, out_features, bias)


def take_rows(weight: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """float32 [len(ids), in]: dequantize only the rows ``ids`` of a quantized matrix (embedding lookup)."""
    def rows(t):
        return None if t is None else t[ids]
    part = weight.with_(codes=weight.codes[ids], scales=weight.scales[ids], zeros=rows(weight.zeros),
                        offsets=rows(weight.offsets), bias=None)
    return part.dequantize()


class Embedding(nn.Module):
    """Token embedding slot: a dense [vocab, dim] table or a quantized one (GGUF ``token_embd``).

    A quantized table is kept in canonical form and only the looked-up rows are
    dequantized, so it costs its quantized size, not a float copy.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight: torch.Tensor | None = None  # dense, compute dtype
        self.quantized: QuantizedWeight | None = None

    @property
    def filled(self) -> bool:
        return self.weight is not None or self.quantized is not None

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [B, T] -> [B, T, D]
        if self.weight is not None:
            return self.weight[ids].to(dtype)
        flat = take_rows(self.quantized, ids.reshape(-1))
        return flat.reshape(*ids.shape, self.embedding_dim).to(dtype)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 as transformers does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight: torch.Tensor | None = None  # [dim], compute dtype

    @property
    def filled(self) -> bool:
        return self.weight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)


# ---- rotary position embeddings ---------------------------------------------

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, from either config spelling.

    transformers >= 5 writes ``rope_parameters: {rope_type, rope_theta, ...}``;
    older configs write ``rope_theta`` and ``rope_scaling: {type|rope_type, ...}``.
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    @classmethod
    def from_config(cls, rope_theta: float | None, rope_scaling: dict | None,
                    rope_parameters: dict | None) -> "RopeConfig":
        params = dict(rope_scaling or {})
        params.update(rope_parameters or {})
        theta = params.get("rope_theta", rope_theta if rope_theta is not None else 10000.0)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ModelError(f"config rope type '{kind}' is not supported; supported: {', '.join(ROPE_TYPES)}")
        return cls(
            theta=float(theta), kind=kind, factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        )


def rope_inv_freq(cfg: RopeConfig, dim: int) -> torch.Tensor:
    """float32 [dim / 2]: the rotation frequency of each pair of channels."""
    inv = 1.0 / (cfg.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if cfg.kind == "linear":
        return inv / cfg.factor
    if cfg.kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
        low_wavelen = cfg.original_max_position / cfg.low_freq_factor
        high_wavelen = cfg.original_max_position / cfg.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / cfg.factor, inv)
        smooth = (cfg.original_max_position / wavelen - cfg.low_freq_factor) / (
            cfg.high_freq_factor - cfg.low_freq_factor)
        smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions (rotate-half layout, as HF checkpoints expect)."""

    def __init__(self, cfg: RopeConfig, dim: int):
        super().__init__()
        self.inv_freq = rope_inv_freq(cfg, dim)  # [dim/2]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] rotated by cos/sin [B, T, D]."""
    return fused.rope_torch(x.transpose(1, 2), cos, sin).transpose(1, 2)


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, Hq, D] and k [B, T, Hk, D] rotated by cos/sin [B, T, D] (one fused call; may reuse q, k)."""
    return fused.rope_qk(q, k, cos, sin)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads.

    q [B, H, T, D], k and v [B, Hkv, S, D] (H a multiple of Hkv), mask bool broadcastable to
    [B, 1, T, S] (True = may attend) or None -> [B, H, T, D].  One query token per sequence
    (decode) goes through :func:`quill.kernels.fused.decode_attention`; prompts through
    ATen's flash kernel.
    """
    if q.shape[2] == 1:
        return fused.decode_attention(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
