"""MoE backend choice as data, with the linear kernels' mechanics (:mod:`quill.kernels.priority`).

    selector = MoESelector(platform, MOE_BACKENDS_REGISTRY.policy_from_env())
    choice = selector.select(cfg, layer="model.layers.0.mlp")

``QUILL_MOE_BACKEND=name`` forces one backend (an error if it cannot run a
layer); ``QUILL_DISABLED_MOE_BACKENDS=a,b`` skips some.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import ClassVar

from quill.kernels.priority import KernelPolicy, PrioritySelector, Registry, Selection
from quill.moe.config import MoELayerConfig

__all__ = ["MOE_BACKENDS", "MOE_PRIORITIES", "MOE_REGISTRY", "KernelPolicy", "MoESelector", "Selection"]

# Every MoE backend quill knows, by name -> "module:Class" (imported on first use).
MOE_BACKENDS: dict[str, str] = {
    "grouped": "quill.moe.grouped:GroupedBackend",
    "reference": "quill.moe.reference:ReferenceBackend",
}

# Priority lists per ISA level (a row only where a list differs from the level below): one for all.
MOE_PRIORITIES: dict[str, tuple[str, ...]] = {
    "scalar": ("grouped", "reference"),
}

MOE_REGISTRY = Registry("MoE backend", MOE_BACKENDS, MOE_PRIORITIES, "QUILL_MOE_BACKEND",
                        "QUILL_DISABLED_MOE_BACKENDS", "quill.moe")


@dataclass
class MoESelector(PrioritySelector):
    """Chooses an MoE backend per layer for one platform and policy; logs each distinct choice once."""

    registry: ClassVar[Registry] = MOE_REGISTRY

    def log_key(self, cfg: MoELayerConfig) -> Hashable:
        return (cfg.bits, cfg.group_size, cfg.per_channel, cfg.symmetric, cfg.has_offsets, cfg.act_order, cfg.act,
                cfg.uniform, cfg.top_k, cfg.num_experts)
