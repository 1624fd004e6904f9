"""The frozen description of an MoE layer that backend selection works on."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quill.errors import ModelError, format_choices
from quill.kernels.config import ActKind, act_kind
from quill.moe.experts import DenseWeight, ExpertWeights, Proj
from quill.platform import Platform

GatedAct = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


# Gated activations an expert MLP may use: down(act(gate(x), up(x))); "silu" is act(g, u) = silu(g) * u
# (Gemma 4's experts: gelu-tanh)
HIDDEN_ACTS: dict[str, GatedAct] = {"silu": _silu_mul, "gelu_pytorch_tanh": _gelu_tanh_mul}
# gpt-oss's clamped SwiGLU, its two constants in the name (so a saved layer config says them):
# "swiglu_clamped(alpha,limit)"
_CLAMPED = re.compile(r"swiglu_clamped\(([-+0-9.e]+),([-+0-9.e]+)\)")


def swiglu_clamped_name(alpha: float, limit: float) -> str:
    return f"swiglu_clamped({float(alpha)!r},{float(limit)!r})"


def _swiglu_clamped(alpha: float, limit: float) -> GatedAct:
    """gpt-oss (transformers' GptOssExperts._apply_gate, llama.cpp's swiglu_oai): gate clamped above at
    ``limit``, up to [-limit, limit], ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return act


def native_activation(name: str) -> tuple[str, float, float] | None:
    """(activation, alpha, limit) as the native ExpertGroup takes them (csrc/moe.cpp), or None when it has
    no such activation."""
    if name == "silu":
        return "silu", 0.0, 0.0
    if name == "gelu_pytorch_tanh":
        return "gelu_tanh", 0.0, 0.0
    m = _CLAMPED.fullmatch(name)
    return ("swiglu_clamped", float(m.group(1)), float(m.group(2))) if m else None


def gated_activation(name: str, layer: str = "moe") -> GatedAct:
    """The gated activation named ``name``, or a ModelError listing the supported ones."""
    if name in HIDDEN_ACTS:
        return HIDDEN_ACTS[name]
    m = _CLAMPED.fullmatch(name)
    if m:
        return _swiglu_clamped(float(m.group(1)), float(m.group(2)))
    raise ModelError(f"{layer}: expert activation '{name}' is not supported; supported: "
                     f"{format_choices([*HIDDEN_ACTS, 'swiglu_clamped(alpha,limit)'])}")


@dataclass(frozen=True)
class MoELayerConfig:
    """Everything an MoE backend may need to decide whether it can run a layer.

    The weight fields describe every projection of every expert.  When they
    differ within the layer (``uniform`` False, e.g. down_proj kept at 8
    bits), they hold the most demanding value: the widest ``bits``, the
    smallest ``group_size`` (``per_channel`` only if every projection is), and
    ``True`` for asymmetric / offsets / act-order if any projection has them,
    so a backend that refuses a feature refuses the layer.  Float experts
    have ``bits`` 16 or 32 and ``group_size`` 0.
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    bits: int
    group_size: int
    per_channel: bool
    symmetric: bool
    has_offsets: bool
    act_order: bool
    act: ActKind
    act_symmetric: bool
    hidden_act: str
    uniform: bool
    platform: Platform

    @property
    def dense(self) -> bool:
        return self.bits >= 16

    @classmethod
    def from_experts(cls, experts: Sequence[ExpertWeights], top_k: int, platform: Platform,
                     hidden_act: str = "silu", layer: str = "moe") -> "MoELayerConfig":
        """Describe ``experts`` (activations already resolved); shapes are taken from expert 0."""
        gated_activation(hidden_act, layer)  # a ModelError for an unknown one
        if not experts or not 1 <= top_k <= len(experts):
            raise ModelError(f"{layer}: top_k {top_k} with {len(experts)} experts; expected 1 <= top_k <= experts")
        descs = {_describe(p) for ex in experts for p in (ex.gate, ex.up, ex.down)}
        gate = experts[0].gate
        return cls(
            num_experts=len(experts), top_k=top_k, hidden_size=gate.in_features,
            intermediate_size=gate.out_features,
            bits=max(d[0] for d in descs), group_size=min((d[1] for d in descs if d[1]), default=0),
            per_channel=all(d[7] for d in descs),
            symmetric=all(d[2] for d in descs), has_offsets=any(d[3] for d in descs),
            act_order=any(d[4] for d in descs), act=_widest_act({d[5] for d in descs}),
            act_symmetric=all(d[6] for d in descs), hidden_act=hidden_act, uniform=len({d[:7] for d in descs}) == 1,
            platform=platform,
        )

    def summary(self) -> str:
        """Short human description, e.g. 'MoE 8x top2 W4A16 g32 sym 128->32'."""
        shape = f"{self.hidden_size}->{self.intermediate_size}"
        head = f"MoE {self.num_experts}x top{self.top_k}"
        if self.dense:
            return f"{head} dense fp{self.bits} {shape}"
        a = {ActKind.FLOAT: "A16", ActKind.INT8_TOKEN: "A8 dyn", ActKind.INT8_TENSOR: "A8 static"}[self.act]
        g = "ch" if self.per_channel else f"g{self.group_size}"
        kind = "sym" if self.symmetric else ("offset" if self.has_offsets else "asym")
        extra = (" act-order" if self.act_order else "") + ("" if self.uniform else " mixed")
        return f"{head} W{self.bits}{a} {g} {kind}{extra} {shape}"


def _describe(p: Proj) -> tuple:
    """(bits, group_size, symmetric, has_offsets, act_order, act, act_symmetric, per_channel) of one projection."""
    if isinstance(p, DenseWeight):
        bits = 32 if p.weight.element_size() >= 4 else 16
        return (bits, 0, True, False, False, ActKind.FLOAT, True, True)
    a = p.activation
    return (p.bits, p.group_size, p.symmetric, p.offsets is not None, p.has_act_order, act_kind(a),
            a is None or a.symmetric, p.per_channel)


def _widest_act(kinds: set[ActKind]) -> ActKind:
    for k in (ActKind.INT8_TENSOR, ActKind.INT8_TOKEN):
        if k in kinds:
            return k
    return ActKind.FLOAT
