"""A quantized linear layer at run time: the selected kernel, its prepared state, the bias.

This is the only object model code touches; it never sees formats or ISAs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from quill.canonical import ActivationQuant, QuantizedWeight
from quill.errors import CacheError, ConfigError, format_choices
from quill.kernels.config import ActKind, LinearLayerConfig
from quill.kernels.dense import DenseLayerConfig, NativeDenseKernel, as_16bit
from quill.kernels.selection import KernelSelector, Selection

ACTIVATION_CHOICES = ("none", "exact", "int8", "int8-group")


def resolve_activation(weight: QuantizedWeight, requested: str | None) -> ActivationQuant | None:
    """The input quantization a layer runs with.

    A checkpoint that prescribes one (W8A8) is honoured as written.  Otherwise
    activations stay float (None, ``"none"``, ``"exact"``) unless the user asked for
    ``"int8"`` (W4A8 / W8A8 dynamic per token, symmetric) or ``"int8-group"`` (one
    scale per token and weight group): never silently.
    """
    if requested not in (None,) + ACTIVATION_CHOICES:
        raise ConfigError(f"activation_quant '{requested}' is not supported; "
                          f"supported: {format_choices(ACTIVATION_CHOICES)}")
    if weight.activation is not None:
        return weight.activation
    if requested == "int8":
        return ActivationQuant(bits=8, dynamic=True, symmetric=True)
    if requested == "int8-group":
        return ActivationQuant(bits=8, dynamic=True, symmetric=True, per_group=True)
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
    state_activation: ActivationQuant | None = None  # the input quantization the state was built for

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
    cfg = LinearLayerConfig.from_weight(weight, selector.platform, selector.threads, selector.exact_float)
    sel = selector.select(cfg, layer=weight.name)
    stored = weight.storage_bytes()
    if not sel.kernel.two_level_scales:  # exact: one float32 scale (offset) per group
        weight = weight.single_level()
    if not sel.kernel.codebook_codes:  # exact: integer codes (FP4 E2M1 x 2: 5-bit), float32 scales
        weight, cfg = weight.uniform(), cfg.as_uniform()
    state = sel.kernel.prepare(weight, cfg)
    bias = None if weight.bias is None else weight.bias.to(bias_dtype).contiguous()
    return QuantLinear(weight.name, weight.in_features, weight.out_features, sel, cfg, state, bias, stored,
                       weight.activation)


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
    words: torch.Tensor | None = None  # int16 [NB, KP, 16, 2]: what `native` reads (kept to be saved)
    stored: torch.dtype | None = None  # the checkpoint's dtype of the weight

    @property
    def kernel_name(self) -> str:
        return "native_dense" if self.native is not None else "dense"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.forward(x, self.bias)  # [..., in] -> [..., out], x's dtype
        return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias)


def build_dense_linear(
    name: str, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
    selector: KernelSelector | None = None,
) -> DenseLinear:
    """Wrap a float weight [out, in]: the dense kernel ``selector.dense`` picks (quill.kernels.dense),
    ``F.linear`` on the weight converted once to ``dtype`` without a selector."""
    stored = weight.numel() * weight.element_size()
    w = weight.to(dtype).contiguous()  # a 16-bit runtime rounds the weight first, as F.linear would use it
    b = None if bias is None else bias.to(dtype).contiguous()
    if selector is not None:
        half = as_16bit(w)
        cfg = DenseLayerConfig(w.shape[1], w.shape[0], weight.dtype, None if half is None else half.dtype,
                               dtype, selector.platform, selector.threads)
        if selector.dense.select(cfg, layer=name).name == "native_dense":
            words = NativeDenseKernel.pack(half)
            return DenseLinear(name, cfg.in_features, cfg.out_features, None, b, stored,
                               NativeDenseKernel.from_packed(words, half.dtype, cfg), half.dtype, words, weight.dtype)
    return DenseLinear(name, w.shape[1], w.shape[0], w, b, stored, None, w.dtype, None, weight.dtype)


# ---- saving a built layer and building it back (the prepacked cache) -----------------------

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16)}


def native_op(impl: object) -> object | None:
    """The C++ linear (csrc/linear_op.h) behind a built linear that runs on a native kernel, else None:
    what the native decode step and the MoE expert group call directly."""
    from quill.kernels.native import NativeState

    if isinstance(impl, QuantLinear) and isinstance(impl.state, NativeState):
        return impl.state.handle
    if isinstance(impl, DenseLinear) and impl.native is not None:
        return impl.native
    return None


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise CacheError(f"saved dtype '{name}' is not one of {format_choices(_DTYPES)}")
    return _DTYPES[name]


def export_linear(impl: QuantLinear | DenseLinear) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """A built layer as JSON-able facts and tensors, or None when its kernel's state cannot be saved."""
    tensors = {} if impl.bias is None else {"bias": impl.bias}
    if isinstance(impl, DenseLinear):
        facts = {"type": "dense", "name": impl.name, "in": impl.in_features, "out": impl.out_features,
                 "weight_bytes": impl.weight_bytes, "dtype": str(impl.dtype).removeprefix("torch."),
                 "stored": str(impl.stored).removeprefix("torch."), "native": impl.native is not None}
        tensors["weight"] = impl.words if impl.native is not None else impl.weight
        return facts, tensors
    saved = impl.selection.kernel.export_state(impl.state)
    if saved is None:
        return None
    state, state_tensors = saved
    cfg = {f.name: getattr(impl.config, f.name) for f in dataclasses.fields(impl.config)
           if f.name not in ("platform", "threads", "exact_float")}
    cfg["act"] = cfg["act"].value
    act = impl.state_activation
    facts = {"type": "quant", "name": impl.name, "kernel": impl.kernel_name, "config": cfg, "state": state,
             "activation": None if act is None else dataclasses.asdict(act), "weight_bytes": impl.weight_bytes}
    tensors.update({f"state.{k}": v for k, v in state_tensors.items()})
    return facts, tensors


def restore_linear(facts: dict, tensors: dict[str, torch.Tensor], selector: KernelSelector,
                   dtype: torch.dtype) -> QuantLinear | DenseLinear:
    """The layer :func:`export_linear` saved, around ``tensors`` as they are; a :class:`CacheError` when the
    kernel chosen now for it is not the one saved (the cache is then rebuilt)."""
    bias = tensors.get("bias")
    name = facts["name"]
    if facts["type"] == "dense":
        held = _dtype(facts["dtype"])
        if not facts["native"]:
            return DenseLinear(name, facts["in"], facts["out"], tensors["weight"], bias, facts["weight_bytes"],
                               None, held, None, _dtype(facts["stored"]))
        cfg = DenseLayerConfig(facts["in"], facts["out"], _dtype(facts["stored"]), held, dtype, selector.platform,
                               selector.threads)
        if selector.dense.select(cfg, layer=name).name != "native_dense":
            raise CacheError(f"{name}: saved for native_dense, which is not the dense kernel chosen now")
        words = tensors["weight"]
        return DenseLinear(name, facts["in"], facts["out"], None, bias, facts["weight_bytes"],
                           NativeDenseKernel.from_packed(words, held, cfg), held, words, _dtype(facts["stored"]))
    cfg = LinearLayerConfig(**{**facts["config"], "act": ActKind(facts["config"]["act"])},
                            platform=selector.platform, threads=selector.threads, exact_float=selector.exact_float)
    sel = selector.select(cfg, layer=name)
    if sel.name != facts["kernel"]:
        raise CacheError(f"{name}: saved for kernel {facts['kernel']}, but {sel.name} is chosen now")
    act = None if facts["activation"] is None else ActivationQuant(**facts["activation"])
    state_tensors = {k.removeprefix("state."): v for k, v in tensors.items() if k.startswith("state.")}
    state = sel.kernel.restore_state(facts["state"], state_tensors, cfg, act, name)
    return QuantLinear(name, cfg.in_features, cfg.out_features, sel, cfg, state, bias, facts["weight_bytes"], act)
