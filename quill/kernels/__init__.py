"""Linear kernels and their selection."""

from quill.kernels.config import ActKind, LinearLayerConfig
from quill.kernels.linear import QuantLinear, build_quant_linear, resolve_activation
from quill.kernels.selection import KERNELS, PRIORITIES, KernelPolicy, KernelSelector, Selection, kernel_class

__all__ = [
    "ActKind", "KERNELS", "KernelPolicy", "KernelSelector", "LinearLayerConfig", "PRIORITIES", "QuantLinear",
    "Selection", "build_quant_linear", "kernel_class", "resolve_activation",
]
