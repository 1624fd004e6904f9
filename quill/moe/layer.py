"""An MoE layer's routed experts at run time: the selected backend and its prepared state.

    moe = build_fused_moe("model.layers.0.mlp", experts, top_k=2,
                          moe_selector=MoESelector(platform, MOE_REGISTRY.policy_from_env()),
                          linear_selector=KernelSelector(platform, KernelPolicy.from_env()))
    weights, ids = route(router_logits, top_k=2, renormalize=True)
    y = moe(x, ids, weights)                      # x [T, H] -> y [T, H]

This is the only MoE object model code touches; it never sees formats, ISAs or backends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from quill.canonical import QuantizedWeight
from quill.errors import CacheError, KernelError
from quill.kernels import (
    ActKind,
    KernelSelector,
    build_dense_linear,
    build_quant_linear,
    export_linear,
    resolve_activation,
    restore_linear,
)
from quill.kernels.priority import Selection
from quill.moe.config import MoELayerConfig
from quill.moe.experts import DenseWeight, ExpertWeights, Proj, check_experts
from quill.moe.selection import MoESelector


@dataclass
class FusedMoE:
    """y = sum over the k routed experts of weight * expert(x); built once at load by :func:`build_fused_moe`."""

    name: str
    config: MoELayerConfig
    selection: Selection
    state: Any
    expert_bytes: list[int]  # bytes each expert's weights occupy in the checkpoint (bandwidth accounting)

    @property
    def backend_name(self) -> str:
        return self.selection.name

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_ids int64 [T, k], topk_weights float [T, k] -> [T, H] in x's dtype."""
        T, k = topk_ids.shape
        if x.dim() != 2 or x.shape != (T, self.config.hidden_size) or topk_weights.shape != (T, k):
            raise KernelError(f"{self.name}: expected x [T, {self.config.hidden_size}] with topk_ids/topk_weights "
                              f"[T, k]; found x {list(x.shape)}, ids {list(topk_ids.shape)}, weights "
                              f"{list(topk_weights.shape)}")
        if T == 0:
            return x.clone()
        return self.selection.kernel.apply(self.state, x, topk_ids, topk_weights)

    def bytes_read(self, topk_ids: torch.Tensor) -> int:
        """Expert weight bytes one call with ``topk_ids`` reads (each distinct expert once)."""
        return sum(self.expert_bytes[e] for e in set(topk_ids.reshape(-1).tolist()))


def linear_factory(selector: KernelSelector, dtype: torch.dtype) -> Callable[[Proj], Any]:
    """Build one run-time linear from a canonical projection through the linear-kernel selector."""
    def make(p: Proj):
        if isinstance(p, DenseWeight):
            return build_dense_linear(p.name, p.weight, p.bias, dtype, selector)
        return build_quant_linear(p, selector, None, bias_dtype=dtype)
    return make


def _with_activation(p: Proj, activation: str | None) -> Proj:
    if isinstance(p, QuantizedWeight):
        return p.with_(activation=resolve_activation(p, activation))
    return p  # a projection the checkpoint left in float stays float (as the tools run it)


def build_fused_moe(
    name: str,
    experts: Sequence[ExpertWeights],
    top_k: int,
    moe_selector: MoESelector,
    linear_selector: KernelSelector,
    activation: str | None = None,
    hidden_act: str = "silu",
    dtype: torch.dtype = torch.float32,
) -> FusedMoE:
    """Select a backend for ``experts`` (canonical weights of any format) and prepare them once.

    ``activation`` is the user's activation quantization request ("int8" for
    W4A8 / W8A8 dynamic), resolved per projection as linear layers resolve it.
    """
    experts = [ExpertWeights(*(_with_activation(p, activation) for p in (ex.gate, ex.up, ex.down)))
               for ex in experts]
    if experts:
        check_experts(name, experts, len(experts), experts[0].gate.in_features, experts[0].gate.out_features)
    cfg = MoELayerConfig.from_experts(experts, top_k, moe_selector.platform, hidden_act, layer=name)
    sel = moe_selector.select(cfg, layer=name)
    state = sel.kernel.prepare(experts, cfg, linear_factory(linear_selector, dtype))
    return FusedMoE(name, cfg, sel, state, [ex.storage_bytes() for ex in experts])


def export_fused_moe(moe: FusedMoE) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """A built MoE layer as JSON-able facts and tensors (the prepacked cache), or None when its backend
    cannot save its state."""
    saved = moe.selection.kernel.export_state(moe.state, export_linear)
    if saved is None:
        return None
    cfg = {f.name: getattr(moe.config, f.name) for f in fields(moe.config) if f.name != "platform"}
    cfg["act"] = cfg["act"].value
    facts = {"name": moe.name, "backend": moe.backend_name, "config": cfg, "state": saved[0],
             "expert_bytes": moe.expert_bytes}
    return facts, saved[1]


def restore_fused_moe(facts: dict, tensors: dict[str, torch.Tensor], moe_selector: MoESelector,
                      linear_selector: KernelSelector, dtype: torch.dtype) -> FusedMoE:
    """The layer :func:`export_fused_moe` saved; a CacheError when another backend is chosen for it now."""
    cfg = MoELayerConfig(**{**facts["config"], "act": ActKind(facts["config"]["act"])},
                         platform=moe_selector.platform)
    sel = moe_selector.select(cfg, layer=facts["name"])
    if sel.name != facts["backend"]:
        raise CacheError(f"{facts['name']}: saved for MoE backend {facts['backend']}, but {sel.name} is chosen now")
    state = sel.kernel.restore_state(facts["state"], tensors, cfg,
                                     lambda f, t: restore_linear(f, t, linear_selector, dtype))
    return FusedMoE(facts["name"], cfg, sel, state, list(facts["expert_bytes"]))
