"""A quantized linear layer at run time: the selected kernel, its prepared state, the bias.

This is the only object model code touches; it never sees formats or ISAs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quill.canonical import ActivationQuant, QuantizedWeight
from quill.errors import ConfigError, format_choices
from quill.kernels.config import LinearLayerConfig
from quill.kernels.selection import KernelSelector, Selection, kernel_class

ACTIVATION_CHOICES = ("none", "int8")


def resolve_activation(weight: QuantizedWeight, requested: str | None) -> ActivationQuant | None:
    """The input quantization a layer runs with.

    A checkpoint that prescribes one (W8A8) is honoured as written.  Otherwise
    activations stay float unless the user asked for ``"int8"`` (W4A8 / W8A8
    dynamic per token, symmetric): never silently.
    """
    if requested not in (None,) + ACTIVATION_CHOICES:
        raise ConfigError(f"activation_quant '{requested}' is not supported; "
                          f"supported: {format_choices(ACTIVATION_CHOICES)}")
    if weight.activation is not None:
        return weight.activation
    if requested == "int8":
        return ActivationQuant(bits=8, dynamic=True, symmetric=True)
    return None


@dataclass
class QuantLinear:
    """y = x @ W^T + b through one kernel; built once at load by :func:`build_quant_linear`."""

    name: str
    in_features: int
    out_features: int
    selection: Selection
    config: LinearLayerConfig
    state: Any
    bias: torch.Tensor | None
    weight_bytes: int  # packed bytes as stored in the checkpoint (for bandwidth accounting)

    @property
    def kernel_name(self) -> str:
        return self.selection.name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.selection.kernel.apply(self.state, x, self.bias)


def build_quant_linear(
    weight: QuantizedWeight,
    selector: KernelSelector,
    activation: str | None = None,
    bias_dtype: torch.dtype = torch.float32,
) -> QuantLinear:
    """Select a kernel for ``weight`` and repack it once."""
    weight = weight.with_(activation=resolve_activation(weight, activation))
    cfg = LinearLayerConfig.from_weight(weight, selector.platform, selector.threads)
    sel = selector.select(cfg, layer=weight.name)
    state = sel.kernel.prepare(weight, cfg)
    bias = None if weight.bias is None else weight.bias.to(bias_dtype).contiguous()
    return QuantLinear(weight.name, weight.in_features, weight.out_features, sel, cfg, state, bias,
                       weight.storage_bytes())


@dataclass
class DenseLinear:
    """y = x @ W^T + b for a layer the checkpoint left unquantized (``ignore``, ``extra_config`` bits=16, ...).

    Held one of two ways.  ``native``: the native dense kernel over the weight's exact
    16-bit words (bfloat16 or float16, or float32 values that are such numbers, e.g. a
    bf16 embedding tied as lm_head), with float32 products and sums: the result of a
    float32 matmul up to summation order, reading half the bytes.  Otherwise ``weight``
    in the compute dtype through ``F.linear``; float32 keeps the layer exact against a
    float32 reference.  Activations are never quantized here: a layer left in float by
    its checkpoint stays float (as the tools run it).
    """

    name: str
    in_features: int
    out_features: int
    weight: torch.Tensor | None  # [out, in], compute dtype (the torch path); None when `native` holds it
    bias: torch.Tensor | None
    weight_bytes: int  # bytes as stored in the checkpoint
    native: Any = None  # quill.native NativeDense
    dtype: torch.dtype = torch.float32  # the weight's dtype as held

    @property
    def kernel_name(self) -> str:
        return "native_dense" if self.native is not None else "dense"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.forward(x, self.bias)  # [..., in] -> [..., out], x's dtype
        return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias)


def _as_16bit(w: torch.Tensor, rows: int = 4096) -> torch.Tensor | None:
    """``w`` as bfloat16 or float16 when that holds every value exactly (checked a slice of rows at a time)."""
    if w.dtype in (torch.bfloat16, torch.float16):
        return w
    if w.dtype != torch.float32 or w.dim() != 2:
        return None
    for half in (torch.bfloat16, torch.float16):
        if all(torch.equal(w[r:r + rows].to(half).float(), w[r:r + rows]) for r in range(0, w.shape[0], rows)):
            return w.to(half)
    return None


# The native dense kernel goes with the native float-activation kernels: disabling either of
# them, or forcing another kernel, keeps dense layers on torch.
NATIVE_FLOAT_KERNELS = ("native_w4a16", "native_w8a16")


def _native_dense(w: torch.Tensor, selector: KernelSelector | None) -> tuple[Any, torch.dtype] | None:
    """(NativeDense over ``w`` (compute dtype), the 16-bit dtype it holds), or None: no selector, the
    native float kernels disabled or another kernel forced, no extension or ISA, or values that are
    not all 16-bit floats."""
    from quill import native
    from quill.native.pack import pack_dense

    policy = selector.policy if selector is not None else None
    if policy is None or any(k in policy.disabled for k in NATIVE_FLOAT_KERNELS):
        return None
    if policy.force not in (None,) + NATIVE_FLOAT_KERNELS:
        return None
    if kernel_class(NATIVE_FLOAT_KERNELS[0]).supported(selector.platform) is not None:
        return None
    half = _as_16bit(w)
    if half is None:
        return None
    ext, isa = native.load().module, native.isa_for(selector.platform)
    dtype = "bfloat16" if half.dtype == torch.bfloat16 else "float16"
    handle = ext.NativeDense(pack_dense(half.contiguous()), w.shape[0], w.shape[1], dtype, isa, selector.threads)
    return handle, half.dtype


def build_dense_linear(
    name: str, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
    selector: KernelSelector | None = None,
) -> DenseLinear:
    """Wrap a float weight [out, in] (converted once to ``dtype``; no copy when it already is).

    With a ``selector`` the native dense kernel holds it when it can (see DenseLinear), unless
    the policy disables the native float kernels or forces another kernel (NATIVE_FLOAT_KERNELS).
    """
    stored = weight.numel() * weight.element_size()
    w = weight.to(dtype).contiguous()
    b = None if bias is None else bias.to(dtype).contiguous()
    held = _native_dense(w, selector)
    if held is not None:
        return DenseLinear(name, w.shape[1], w.shape[0], None, b, stored, *held)
    return DenseLinear(name, w.shape[1], w.shape[0], w, b, stored, None, w.dtype)
