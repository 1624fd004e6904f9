"""Rotary position embeddings: config (either spelling), frequency tables, the fused q/k rotation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from quill.errors import ModelError
from quill.kernels import fused

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


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
    # YaRN (gpt-oss): the ramp between interpolated and extrapolated frequencies, and cos / sin scaled by
    # attention_factor (None: 0.1 ln(factor) + 1, or the mscale ratio when both are given)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    # "proportional" (Gemma 4's global layers): the first partial_rotary_factor of each head's channel pairs
    # turn at base ** (-2i / head_dim), the rest not at all (frequency 0: cos 1, sin 0)
    partial_rotary_factor: float = 1.0

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
            beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)), attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
            partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
        )

    @property
    def cos_sin_scale(self) -> float:
        """What cos and sin are multiplied by (1 but for YaRN), as transformers' ``attention_scaling``."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if self.mscale and self.mscale_all_dim:
            return get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim)
        return get_mscale(self.factor)


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
    if cfg.kind == "yarn":
        return _yarn_inv_freq(cfg, dim, inv)
    if cfg.kind == "proportional":  # transformers' _compute_proportional_rope_parameters
        turned = int(cfg.partial_rotary_factor * dim // 2)
        return torch.cat([inv[:turned], torch.zeros(dim // 2 - turned)]) / cfg.factor
    return inv


def _yarn_inv_freq(cfg: RopeConfig, dim: int, inv: torch.Tensor) -> torch.Tensor:
    """YaRN (transformers' ``_compute_yarn_parameters``): frequencies that turn fewer than ``beta_slow``
    times over the original context are interpolated (divided by ``factor``), those turning more than
    ``beta_fast`` times kept, a linear ramp over the channel pairs between."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(cfg.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(cfg.theta))
    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = cfg.theta ** (torch.arange(0, dim, 2).float() / dim)
    return (1.0 / (cfg.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions (rotate-half layout, as HF checkpoints expect)."""

    def __init__(self, cfg: RopeConfig, dim: int):
        super().__init__()
        self.inv_freq = rope_inv_freq(cfg, dim)  # [dim/2]
        self.scale = cfg.cos_sin_scale

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, dim]
        if self.scale != 1.0:  # YaRN: scaled in float32 before the cast, as transformers does
            return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope_q(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q [B, T, Hq, D] rotated by cos/sin [B, T, D] (a query without keys; may reuse q)."""
    return fused.rope(q, cos, sin)


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, Hq, D] and k [B, T, Hk, D] rotated by cos/sin [B, T, D] (one fused call; may reuse q, k)."""
    return fused.rope_qk(q, k, cos, sin)
