"""Native MXFP4 kernels: FP4 E2M1 codes with an E8M0 scale per 32 columns, read at their stored
4.25 bits per weight (``csrc/mxfp4.h``; repacked once by :mod:`quill.native.mxfp4_pack`).

* ``native_mxfp4a16``: float activations (float32, bfloat16, float16 widened to float32); per
  group the sum of ``2 x E2M1`` values times x in float32, then one fused multiply-add with the
  power-of-two scale.
* ``native_mxfp4a8``: int8 activations with one scale per token and 32-column group (llama.cpp's
  MXFP4 x Q8 arithmetic: ``2 x E2M1`` is an integer in [-12, 12], so the dot products are exact
  int32), chosen when the run asks ``activation_quant="int8-group"`` (the GGUF default).

Both are data to the selector: ``can_implement`` accepts only FP4 E2M1 codebook codes with E8M0
scales in groups of 32.  Other kernels run an MXFP4 layer in its uniform 5-bit form (exact, at
more bytes).  The state is a :class:`~quill.kernels.native.NativeState`, so the MoE expert group
and the native decode step call the C++ linear directly.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from quill import native
from quill.canonical import FP4_E2M1, QuantizedWeight
from quill.errors import KernelError
from quill.kernels.base import LinearKernel
from quill.kernels.config import ActKind, LinearLayerConfig
from quill.kernels.native import NativeState
from quill.native.mxfp4_pack import PackedMxfp4, pack_mxfp4
from quill.platform import Platform

_FP4 = tuple(FP4_E2M1.tolist())


class _NativeMxfp4Kernel(LinearKernel):
    codebook_codes = True
    int8: ClassVar[bool]

    @classmethod
    def supported(cls, platform: Platform) -> str | None:
        return native.unsupported(platform)

    @classmethod
    def variant(cls, platform: Platform) -> str:
        return native.isa_for(platform) or "none"

    @classmethod
    def can_implement(cls, cfg: LinearLayerConfig) -> str | None:
        if cfg.codebook != _FP4 or not cfg.e8m0_scales:
            return "runs FP4 E2M1 codes with E8M0 scales (MXFP4) only"
        if cfg.group_size != 32:
            return f"runs groups of 32 columns, found {cfg.group_size}"
        if cls.int8 and cfg.act != ActKind.INT8_GROUP:
            return f"runs int8 activations with one scale per 32-column group, found {cfg.act.value}"
        if not cls.int8 and cfg.act != ActKind.FLOAT:
            return f"runs float activations, found {cfg.act.value}"
        return None

    @classmethod
    def prepare(cls, weight: QuantizedWeight, cfg: LinearLayerConfig) -> NativeState:
        isa = native.isa_for(cfg.platform)
        if isa is None:
            raise KernelError(f"{weight.name}: {cls.name} needs {native.isa_requirement()}")
        packed = pack_mxfp4(weight)
        return NativeState(packed, make_handle(packed, weight.name, isa, cfg.threads, cls.int8), isa)

    @classmethod
    def apply(cls, state: NativeState, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return state.handle.forward(x, bias)

    @classmethod
    def state_bytes(cls, state: NativeState) -> int:
        return sum(t.numel() * t.element_size() for t in (state.packed.codes, state.packed.scales))


def make_handle(packed: PackedMxfp4, name: str, isa: str, threads: int, int8: bool):
    """The C++ NativeMxfp4 over ``packed`` ('avx512', 'avx2' or 'scalar')."""
    ext = native.load()
    if ext.module is None:
        raise KernelError(f"{name}: native kernels unavailable: {ext.error}")
    return ext.module.NativeMxfp4(packed.codes, packed.scales, packed.out_features, packed.in_features,
                                  "int8" if int8 else "float", isa, threads=threads)


class NativeMxfp4A16Kernel(_NativeMxfp4Kernel):
    name = "native_mxfp4a16"
    int8 = False


class NativeMxfp4A8Kernel(_NativeMxfp4Kernel):
    name = "native_mxfp4a8"
    int8 = True
