"""The frozen description of a linear layer that kernel selection works on."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

from quill.canonical import E8M0, ActivationQuant, QuantizedWeight
from quill.platform import Platform


class ActKind(str, Enum):
    """Precision of a layer's input at run time."""

    FLOAT = "float"  # 16/32-bit float activations (W4A16, W8A16)
    INT8_TOKEN = "int8_dynamic_token"  # int8, one scale per token computed at run time (W4A8, W8A8 dynamic)
    INT8_TENSOR = "int8_static_tensor"  # int8, one scale for the tensor from the checkpoint (W8A8 static)
    INT8_GROUP = "int8_dynamic_group"  # int8, one scale per token and weight group computed at run time


@dataclass(frozen=True)
class LinearLayerConfig:
    """Everything a kernel may need to decide whether it can run a layer."""

    in_features: int
    out_features: int
    bits: int
    group_size: int  # == in_features for per-channel
    symmetric: bool
    has_offsets: bool
    act_order: bool
    act: ActKind
    act_symmetric: bool
    platform: Platform
    threads: int = 1  # the run's threads (RunOptions.threads), handed to native kernels
    two_level: bool = False  # scales (mins) are a float per super-block x a small integer per group (K-quants)
    # codes index a value table (MXFP4's FP4 E2M1): the bits of their exact uniform form (weight.uniform()),
    # which kernels that read no codebook are asked about instead; None: the codes are uniform
    uniform_bits: int | None = None
    codebook: tuple[float, ...] | None = None  # the codes' values (with uniform_bits)
    e8m0_scales: bool = False  # scales are E8M0 powers of two, one byte each (MXFP4)
    # float activations exact to float32 rounding (activation_quant="exact"; native kernels: the 24-bit image
    # of the input instead of the 16-bit one); a run option like threads, not part of the saved layout
    exact_float: bool = False

    @property
    def per_channel(self) -> bool:
        return self.group_size == self.in_features

    @property
    def num_groups(self) -> int:
        return self.in_features // self.group_size

    @classmethod
    def from_weight(cls, w: QuantizedWeight, platform: Platform, threads: int | None = None,
                    exact_float: bool = False) -> "LinearLayerConfig":
        """Describe ``w`` (with its ``activation`` already resolved by the caller); ``threads`` defaults
        to the platform's default threads (physical cores this process may use)."""
        return cls(
            in_features=w.in_features, out_features=w.out_features, bits=w.bits, group_size=w.group_size,
            symmetric=w.symmetric, has_offsets=w.offsets is not None, act_order=w.has_act_order,
            act=act_kind(w.activation), act_symmetric=w.activation is None or w.activation.symmetric,
            platform=platform, threads=threads or platform.default_threads, two_level=w.two_level,
            uniform_bits=None if w.codebook is None else w.uniform_bits(),
            codebook=None if w.codebook is None else tuple(w.codebook.tolist()), e8m0_scales=w.scales.dtype == E8M0,
            exact_float=exact_float,
        )

    def as_uniform(self) -> "LinearLayerConfig":
        """The layer as a kernel that reads no codebook runs it (``weight.uniform()``); ``self`` if uniform."""
        if self.uniform_bits is None:
            return self
        return dataclasses.replace(self, bits=self.uniform_bits, uniform_bits=None, codebook=None, e8m0_scales=False)

    def summary(self) -> str:
        """Short human description, e.g. 'W4A16 g128 sym 4096x4096'."""
        a = {ActKind.FLOAT: "A16", ActKind.INT8_TOKEN: "A8 dyn", ActKind.INT8_TENSOR: "A8 static",
             ActKind.INT8_GROUP: "A8 dyn/group"}[self.act]
        g = "ch" if self.per_channel else f"g{self.group_size}"
        kind = "sym" if self.symmetric else ("offset" if self.has_offsets else "asym")
        extra = ((" act-order" if self.act_order else "") + (" 2-level" if self.two_level else "")
                 + (" codebook" if self.uniform_bits is not None else ""))
        return f"W{self.bits}{a} {g} {kind}{extra} {self.out_features}x{self.in_features}"


def act_kind(a: ActivationQuant | None) -> ActKind:
    if a is None:
        return ActKind.FLOAT
    if not a.dynamic:
        return ActKind.INT8_TENSOR
    return ActKind.INT8_GROUP if a.per_group else ActKind.INT8_TOKEN
