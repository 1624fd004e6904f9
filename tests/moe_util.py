"""Synthetic experts for MoE tests and benchmarks: canonical weights of every format shape."""

from __future__ import annotations

import torch

from quill.bench.stats import sqnr_db  # noqa: F401  (re-exported for the MoE tests)
from quill.kernels import KernelPolicy, KernelSelector
from quill.moe import MOE_REGISTRY, DenseWeight, ExpertWeights, MoESelector, build_fused_moe
from quill.platform import Platform
from quill.writers.rtn import quantize_rtn

PLAT = Platform(vendor="AMD", microarch="zen3", flags=frozenset({"avx2", "fma", "f16c"}))

# name -> quantize_rtn keyword arguments, or a float dtype for unquantized experts
FORMATS: dict[str, dict | torch.dtype] = {
    "w4-sym-g32": dict(bits=4, group_size=32),
    "w4-asym-g32": dict(bits=4, group_size=32, symmetric=False),
    "w4-offsets-g32": dict(bits=4, group_size=32, symmetric=False, offsets=True),
    "w4-sym-channel": dict(bits=4, group_size=-1),
    "w4-actorder-g32": dict(bits=4, group_size=32, act_order=True),
    "w8-sym-channel": dict(bits=8, group_size=-1),
    "w8-asym-g64": dict(bits=8, group_size=64, symmetric=False),
    "w3-sym-g32": dict(bits=3, group_size=32),
    "w2-asym-g32": dict(bits=2, group_size=32, symmetric=False),
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}


def make_proj(w: torch.Tensor, fmt: dict | torch.dtype, name: str, gen: torch.Generator):
    if isinstance(fmt, torch.dtype):
        return DenseWeight(w.to(fmt), None, name)
    qw = quantize_rtn(w, generator=gen, **fmt)
    qw = qw.with_(name=name)
    return qw


def make_experts(num_experts: int, hidden: int, inter: int, fmt: dict | torch.dtype, seed: int = 0,
                 down_fmt: dict | torch.dtype | None = None, layer: str = "model.layers.0.mlp") -> list[ExpertWeights]:
    """Random experts (weights ~ N(0, 0.1)); ``down_fmt`` gives down_proj its own format (mixed layers)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for e in range(num_experts):
        ws = [torch.randn(inter, hidden, generator=gen) * 0.1, torch.randn(inter, hidden, generator=gen) * 0.1,
              torch.randn(hidden, inter, generator=gen) * 0.1]
        fmts = (fmt, fmt, fmt if down_fmt is None else down_fmt)
        names = [f"{layer}.experts.{e}.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
        out.append(ExpertWeights(*(make_proj(w, f, n, gen) for w, f, n in zip(ws, fmts, names))))
    return out


def selectors(moe_policy=None, linear_policy=None, platform: Platform = PLAT, moe_priorities=None,
              linear_priorities=None) -> tuple[MoESelector, KernelSelector]:
    moe = MoESelector(platform, moe_policy or MOE_REGISTRY.policy_from_env({}), moe_priorities)
    lin = KernelSelector(platform, linear_policy or KernelPolicy(), linear_priorities)
    return moe, lin


def build(experts, top_k, backend: str, activation=None, dtype=torch.float32, platform: Platform = PLAT):
    """A FusedMoE on ``backend`` (forced), linear kernels chosen normally (for ``platform``: PLAT is AVX2)."""
    moe_sel, lin_sel = selectors(MOE_REGISTRY.policy_from_env({"QUILL_MOE_BACKEND": backend}), platform=platform)
    return build_fused_moe("model.layers.0.mlp", experts, top_k, moe_sel, lin_sel, activation, dtype=dtype)
