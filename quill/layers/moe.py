"""Mixture-of-experts building blocks the MoE model files wire together.

Experts are slots like linears, with HF names (``mlp.experts.<e>.gate_proj``),
but an :class:`ExpertSlot` keeps the checkpoint's canonical weight (a
``QuantizedWeight`` of any format, or a float tensor) instead of building a
kernel: its :class:`SparseMoeBlock` hands all of them to one MoE backend
(``quill.moe``) the moment the last one arrives.  Loading stays streamed: one
MoE layer's canonical experts are in memory at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from quill.canonical import QuantizedWeight
from quill.errors import CacheError, CheckpointError, ModelError, NotCacheable
from quill.kernels import LinearLayerConfig, fused
from quill.layers.context import LayerInfo, LoadContext
from quill.layers.decoder import SOFTMAX_TOP_K, MoESpec
from quill.layers.slots import PostLoad, Saved, Slot, check_qshape, checked, checked_bias, linear
from quill.moe import DenseWeight, ExpertWeights, FusedMoE, build_fused_moe, export_fused_moe, restore_fused_moe, route
from quill.moe.config import swiglu_clamped_name  # noqa: F401  (a model names its experts' activation)
from quill.moe.experts import Proj


class ExpertSlot(nn.Module, Slot):
    """One expert projection; the loader fills it with a canonical weight, its block consumes it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bias
        self.weight: Proj | None = None  # until the block has built its backend
        self.loaded = False
        self.facts: dict = {}  # what `quill inspect` shows about the stored weight
        self.kernel_name = "empty"
        self.refusals: tuple[tuple[str, str], ...] = ()
        self.on_fill: Callable[[LoadContext], None] | None = None
        self._pending: dict[str, torch.Tensor] = {}  # dense weight / bias until finish

    @property
    def filled(self) -> bool:
        return self.loaded

    def load_tensor(self, name: str, attr: str, tensor: torch.Tensor, ctx: LoadContext) -> bool:
        if attr not in ("weight", "bias"):
            return False
        self._pending[attr] = tensor
        return True

    def load_quantized(self, name: str, weight: QuantizedWeight, ctx: LoadContext) -> bool:
        """Kept canonical: its MoE block prepares all experts at once."""
        check_qshape(ctx, name, weight, self.out_features, self.in_features)
        bias = weight.bias if weight.bias is not None else self._pending.get("bias")
        bias = checked_bias(ctx, name, self.has_bias, self.out_features, bias)
        self._pending = {}
        self.fill(name, weight.with_(bias=bias, name=name), ctx)
        return True

    def finish(self, name: str, ctx: LoadContext) -> bool:
        parts, self._pending = self._pending, {}
        if self.loaded or "weight" not in parts:
            return False  # loaded quantized, or reported as missing by the block
        w = checked(ctx, f"{name}.weight", parts["weight"], (self.out_features, self.in_features))
        bias = checked_bias(ctx, name, self.has_bias, self.out_features, parts.get("bias"))
        self.fill(name, DenseWeight(w, bias, name), ctx)
        return True

    def check_filled(self, name: str, ctx: LoadContext) -> None:
        """Missing experts are reported by their block (post_load), all at once."""

    def info(self, name: str) -> LayerInfo | None:
        return LayerInfo(name, "expert", kernel=self.kernel_name, refusals=self.refusals,
                         num_weights=self.in_features * self.out_features, **self.facts)

    def fill(self, name: str, weight: Proj, ctx: LoadContext) -> None:
        if self.loaded:
            raise CheckpointError(f"expert projection '{name}' is provided twice by the checkpoint")
        self.weight, self.loaded = weight, True
        self.facts = _facts(weight, ctx)
        if self.on_fill is not None:
            self.on_fill(ctx)

    def take(self) -> Proj:
        w, self.weight = self.weight, None
        return w

    def save(self, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
        """Only what ``quill inspect`` shows: the weights live in the block's saved MoE layer."""
        return {"kernel": self.kernel_name, "refusals": self.refusals, "facts": self.facts}, {}

    def restore(self, name: str, facts: dict, tensors: dict[str, torch.Tensor], ctx: LoadContext) -> None:
        self.kernel_name, self.facts, self.loaded = facts["kernel"], facts["facts"], True
        self.refusals = tuple(tuple(r) for r in facts["refusals"])

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.kernel_name}"


def _facts(w: Proj, ctx: LoadContext) -> dict:
    if isinstance(w, QuantizedWeight):
        summary = LinearLayerConfig.from_weight(w, ctx.selector.platform).summary()
        return dict(summary=summary, bits=w.bits, group_size=w.group_size, symmetric=w.symmetric,
                    weight_bytes=w.storage_bytes())
    dtype = str(w.weight.dtype).removeprefix("torch.")
    return dict(summary=f"dense {dtype} {w.out_features}x{w.in_features}", bits=None, group_size=None,
                symmetric=None, weight_bytes=w.storage_bytes())


class ExpertMLP(nn.Module):
    """One expert's three projection slots, under the checkpoint's names (gate, up, down order)."""

    def __init__(self, hidden: int, intermediate: int, names: tuple[str, str, str], bias: bool = False):
        super().__init__()
        self.names = names
        shapes = ((hidden, intermediate), (hidden, intermediate), (intermediate, hidden))
        for n, (i, o) in zip(names, shapes):
            setattr(self, n, ExpertSlot(i, o, bias))

    def slots(self) -> tuple[ExpertSlot, ExpertSlot, ExpertSlot]:
        return tuple(getattr(self, n) for n in self.names)


class SparseMoeBlock(nn.Module, PostLoad, Saved):
    """Router (``gate``) and routed experts: softmax, top-k, optional renormalization, fused experts.

    ``round_weights``: cast the routing weights to the model dtype before
    combining, as transformers' Qwen-MoE routers do (a no-op in float32).
    ``router_bias`` / ``expert_bias``: the router and every expert projection add a bias (gpt-oss);
    ``hidden_act`` names the experts' gated activation (``quill.moe.config.gated_activation``).
    """

    def __init__(self, name: str, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 renormalize: bool, hidden_act: str = "silu", round_weights: bool = False,
                 expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 router_bias: bool = False, expert_bias: bool = False):
        super().__init__()
        self.name = name
        self.top_k, self.renormalize, self.hidden_act = top_k, renormalize, hidden_act
        self.round_weights = round_weights
        self.gate = linear(hidden, num_experts, router_bias)
        self.experts = nn.ModuleList([ExpertMLP(hidden, intermediate, expert_names, expert_bias)
                                      for _ in range(num_experts)])
        self._missing = 3 * num_experts
        for ex in self.experts:
            for s in ex.slots():
                s.on_fill = self._slot_filled
        self.fused: FusedMoE | None = None

    def _slot_filled(self, ctx: LoadContext) -> None:
        self._missing -= 1
        if self._missing == 0:
            self._build(ctx)

    def deliver(self, expert: int, part: str, weight: Proj, ctx: LoadContext) -> None:
        """Fill expert ``expert``'s projection ``part`` with ``weight`` cut from a stacked tensor
        (quill.layers.stacked_experts), checked as a per-expert tensor would be."""
        slot = getattr(self.experts[expert], part)
        name = f"{self.name}.experts.{expert}.{part}"
        if (weight.out_features, weight.in_features) != (slot.out_features, slot.in_features):
            raise CheckpointError(f"{ctx.where}: expert projection '{name}' is [{weight.out_features}, "
                                  f"{weight.in_features}], the model expects [{slot.out_features}, {slot.in_features}]")
        checked_bias(ctx, name, slot.has_bias, slot.out_features, weight.bias)
        slot.fill(name, weight.with_(name=name) if isinstance(weight, QuantizedWeight)
                  else dataclasses.replace(weight, name=name), ctx)

    def _build(self, ctx: LoadContext) -> None:
        """All experts are in: choose a backend and prepare them once, then drop the canonical weights."""
        experts = [ExpertWeights(*(s.take() for s in ex.slots())) for ex in self.experts]
        self.fused = build_fused_moe(self.name, experts, self.top_k, ctx.moe_selector, ctx.selector,
                                     ctx.activation, self.hidden_act, ctx.dtype)
        for ex in self.experts:
            for s in ex.slots():
                s.kernel_name, s.refusals = f"moe:{self.fused.backend_name}", self.fused.selection.refusals

    def save(self, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
        saved = export_fused_moe(self.fused) if self.fused is not None else None
        if saved is None:
            raise NotCacheable(f"{name}: MoE backend {self.fused and self.fused.backend_name} does not save its state")
        return saved

    def restore(self, name: str, facts: dict, tensors: dict[str, torch.Tensor], ctx: LoadContext) -> None:
        if len(facts["expert_bytes"]) != len(self.experts):
            raise CacheError(f"{name}: saved with {len(facts['expert_bytes'])} experts, the model has "
                             f"{len(self.experts)}")
        self.fused = restore_fused_moe(facts, tensors, ctx.moe_selector, ctx.selector, ctx.dtype)

    def post_load(self) -> None:
        """Every expert arrived (the block was built when the last did), or a CheckpointError saying which not."""
        if self.fused is not None:
            return
        missing = [f"{self.name}.experts.{e}.{n}" for e, ex in enumerate(self.experts)
                   for n, s in zip(ex.names, ex.slots()) if not s.filled]
        absent = [e for e, ex in enumerate(self.experts) if not any(s.filled for s in ex.slots())]
        whole = f"; experts with no tensors at all: {absent}" if absent else ""
        raise CheckpointError(f"{self.name}: the config says {len(self.experts)} experts, but the checkpoint lacks "
                              f"{len(missing)} expert projection(s), first '{missing[0]}'{whole}")

    def spec(self) -> MoESpec:
        """This block described (quill.layers.decoder), with its experts' native group once built."""
        group = getattr(self.fused.state, "group", None) if self.fused is not None else None
        return MoESpec(self.name, self.gate, SOFTMAX_TOP_K, self.top_k, self.renormalize, group,
                       activation=self.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, H]
        B, T, H = x.shape
        x2 = x.reshape(-1, H)  # [BT, H]
        logits = self.gate(x2)  # [BT, E]
        weights, ids = route(logits, self.top_k, self.renormalize)  # [BT, k] each
        if self.round_weights:
            weights = weights.to(logits.dtype)
        return self.fused(x2, ids, weights).reshape(B, T, H)


class SharedExpertMoeBlock(SparseMoeBlock):
    """Qwen2-MoE: routed experts plus an always-on ``shared_expert`` scaled by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, name: str, shared_expert: nn.Module, hidden: int, **moe):
        super().__init__(name, hidden, **moe)
        self.shared_expert = shared_expert
        self.shared_expert_gate = linear(hidden, 1, False)

    def spec(self) -> MoESpec:
        return dataclasses.replace(super().spec(), shared_expert=self.shared_expert.spec(),
                                   shared_gate=self.shared_expert_gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, H]
        routed = super().forward(x)
        return routed + fused.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def check_moe_config(model_type: str, num_layers: int, num_experts: int, top_k: int, moe_intermediate: int,
                     sparse_step: int = 1, mlp_only_layers=()) -> None:
    """The MoE fields of a config, checked with ModelErrors naming the field."""
    for field, v in (("num_experts", num_experts), ("num_experts_per_tok", top_k),
                     ("moe_intermediate_size", moe_intermediate), ("decoder_sparse_step", sparse_step)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ModelError(f"config ({model_type}) field '{field}': expected a positive integer, found {v!r}")
    if top_k > num_experts:
        raise ModelError(f"config ({model_type}): num_experts_per_tok {top_k} exceeds the {num_experts} experts")
    bad = [i for i in mlp_only_layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise ModelError(f"config ({model_type}) field 'mlp_only_layers': {bad} are not layer indices "
                         f"in [0, {num_layers})")


def is_sparse_layer(layer: int, num_experts: int, sparse_step: int, mlp_only_layers) -> bool:
    """Qwen-MoE's rule: sparse unless listed in mlp_only_layers, every ``decoder_sparse_step``-th layer."""
    return layer not in mlp_only_layers and num_experts > 0 and (layer + 1) % sparse_step == 0


def expert_count(model_type: str, num_experts: int | None, num_local_experts: int | None, default: int) -> int:
    """The expert count under either spelling (transformers 5 writes ``num_local_experts`` for every MoE)."""
    if num_experts is not None and num_local_experts is not None and num_experts != num_local_experts:
        raise ModelError(f"config ({model_type}): num_experts {num_experts} and num_local_experts "
                         f"{num_local_experts} disagree")
    n = num_experts if num_experts is not None else num_local_experts
    return default if n is None else n
