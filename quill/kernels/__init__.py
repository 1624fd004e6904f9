"""Linear kernels and their selection."""

from quill.kernels.config import ActKind, LinearLayerConfig
from quill.kernels.linear import (
    DenseLinear,
    QuantLinear,
    build_dense_linear,
    build_quant_linear,
    export_linear,
    resolve_activation,
    restore_linear,
)
from quill.kernels.selection import KERNELS, PRIORITIES, KernelPolicy, KernelSelector, Selection, kernel_class

__all__ = [
    "ActKind", "DenseLinear", "KERNELS", "KernelPolicy", "KernelSelector", "LinearLayerConfig", "PRIORITIES",
    "QuantLinear",
    "Selection", "build_dense_linear", "build_quant_linear", "export_linear", "kernel_class", "resolve_activation",
    "restore_linear",
]
