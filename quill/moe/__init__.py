"""Mixture-of-experts layers: canonical experts, backends chosen like linear kernels, routers."""

from quill.moe.base import LinearFactory, MoEBackend
from quill.moe.config import HIDDEN_ACTS, MoELayerConfig
from quill.moe.experts import DenseWeight, ExpertWeights, check_experts, stack_gate_up
from quill.moe.layer import FusedMoE, build_fused_moe, export_fused_moe, linear_factory, restore_fused_moe
from quill.moe.router import route
from quill.moe.selection import MOE_BACKENDS, MOE_PRIORITIES, MOE_REGISTRY, MoESelector

__all__ = [
    "DenseWeight", "ExpertWeights", "FusedMoE", "HIDDEN_ACTS", "LinearFactory", "MOE_BACKENDS", "MOE_PRIORITIES",
    "MOE_REGISTRY", "MoEBackend", "MoELayerConfig", "MoESelector", "build_fused_moe", "check_experts",
    "export_fused_moe", "linear_factory", "restore_fused_moe", "route", "stack_gate_up",
]
