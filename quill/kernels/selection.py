"""Kernel choice as data: priority lists per ISA level, a user policy, one error listing every refusal.

    selector = KernelSelector(platform, KernelPolicy.from_env())
    choice = selector.select(cfg, layer="model.layers.0.self_attn.q_proj")
    state = choice.kernel.prepare(weight, cfg)

``QUILL_KERNEL=name`` forces one kernel (an error if it cannot run a layer);
``QUILL_DISABLED_KERNELS=a,b`` skips some.  The environment is read once, by
:meth:`KernelPolicy.from_env`, never inside selection.  The mechanics (shared with
the MoE backends) are in :mod:`quill.kernels.priority`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import ClassVar

from quill.kernels.base import LinearKernel
from quill.kernels.config import LinearLayerConfig
from quill.kernels.dense import DenseSelector
from quill.kernels.priority import KernelPolicy, PrioritySelector, Registry, Selection

__all__ = ["KERNELS", "LINEAR_KERNELS", "PRIORITIES", "KernelPolicy", "KernelSelector", "Selection", "kernel_class"]

# Every linear kernel quill knows, by name -> "module:Class" (imported on first use).
KERNELS: dict[str, str] = {
    "native_mxfp4a16": "quill.kernels.mxfp4:NativeMxfp4A16Kernel",
    "native_mxfp4a8": "quill.kernels.mxfp4:NativeMxfp4A8Kernel",
    "native_w3a16": "quill.kernels.native:NativeW3A16Kernel",
    "native_w3a8": "quill.kernels.native:NativeW3A8Kernel",
    "native_w4a16": "quill.kernels.native:NativeW4A16Kernel",
    "native_w4a8": "quill.kernels.native:NativeW4A8Kernel",
    "native_w6a16": "quill.kernels.native:NativeW6A16Kernel",
    "native_w6a8": "quill.kernels.native:NativeW6A8Kernel",
    "native_w8a8": "quill.kernels.native:NativeW8A8Kernel",
    "native_w8a16": "quill.kernels.native:NativeW8A16Kernel",
    "zentorch": "quill.kernels.zentorch_ops:ZentorchKernel",
    "zentorch_woq": "quill.kernels.zentorch_ops:ZentorchWoqKernel",
    "torch": "quill.kernels.torch_ops:TorchKernel",
    "reference": "quill.kernels.reference:ReferenceKernel",
}

# Priority lists per ISA level (Platform.isa_level), best first.  Kernels that
# cannot run on a CPU say so through ``supported`` (native: AVX2 or better and a built
# extension; zentorch: AMD Zen with AVX-512 only); the lists only say what to try.
# Registered kernels listed nowhere (zentorch_woq) run only when forced with QUILL_KERNEL.
# The native kernels come first: decode (M = 1) streams weights ~2x faster than torch
# int4pack (docs/lab/BENCHMARKS-notebook.md); native_w8a8 vs zentorch, 4096x4096, 2 threads: 0.50 vs
# 0.67 ms at M = 1, 0.85 vs 0.98 at M = 16, but 7.2 vs 5.7 ms at M = 128.
# MXFP4 first: only they read its codes as stored (the others run its exact 5-bit uniform form)
_NATIVE = ("native_mxfp4a16", "native_mxfp4a8",
           "native_w3a16", "native_w3a8", "native_w4a16", "native_w4a8", "native_w6a16", "native_w6a8",
           "native_w8a8", "native_w8a16")
PRIORITIES: dict[str, tuple[str, ...]] = {
    # every level from AVX2 up (avx_vnni, avx512, avx512_vnni, amx): the native kernels pick their
    # own variant of the one ISA decision (quill.native.isa_for)
    "avx2": _NATIVE + ("zentorch", "torch", "reference"),
    "scalar": ("zentorch", "torch", "reference"),  # the native scalar twins are oracles, slower than torch
}


LINEAR_KERNELS = Registry("kernel", KERNELS, PRIORITIES, "QUILL_KERNEL", "QUILL_DISABLED_KERNELS", "quill.kernels")


def kernel_class(name: str) -> type[LinearKernel]:
    return LINEAR_KERNELS.load(name)


@dataclass
class KernelSelector(PrioritySelector):
    """Chooses a linear kernel per layer for one platform and policy; logs each distinct choice once."""

    registry: ClassVar[Registry] = LINEAR_KERNELS
    # float activations exact to float32 rounding (activation_quant="exact"): every layer's config says so
    exact_float: bool = False
    dense: DenseSelector = field(init=False, repr=False)  # the dense-kernel family under the same policy

    def __post_init__(self):
        super().__post_init__()
        self.dense = DenseSelector.for_linear(self.platform, self.policy, self.threads)

    def refusal(self, impl: type[LinearKernel], cfg: LinearLayerConfig) -> str | None:
        # a kernel that reads no codebook runs codebook codes in their exact uniform form
        return super().refusal(impl, cfg if impl.codebook_codes else cfg.as_uniform())

    def log_key(self, cfg: LinearLayerConfig) -> Hashable:
        return (cfg.bits, cfg.group_size, cfg.symmetric, cfg.has_offsets, cfg.act_order, cfg.act, cfg.uniform_bits)
