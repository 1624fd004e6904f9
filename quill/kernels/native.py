"""Native CPU kernels (quill/native): W4A16, W6A16, W8A16, W4A8, W6A8, W8A8 at the memory-bandwidth limit.

Eight registered kernels share one implementation, differing in the code width
they accept (``native_w3*``: 2-3 bit codes at their stored bits, 2-bit pairs plus a
plane of third bits; ``native_w4*``: 4-bit, and 2-3 bit widened to 4 when the
``w3`` kernels are disabled; ``native_w6*``: 5-6 bit codes, 4-bit nibbles plus a
high-bit plane; ``native_w8*``: 8-bit) and in their activations.  All read
two-level scales (GGUF K-quants) as stored: an integer per group (int8, or 4 / 6
bits packed for Q2_K / Q3_K) times a float per super-block.

* ``native_w4a16`` / ``native_w6a16`` / ``native_w8a16``: float activations (float32, bfloat16,
  float16), entered as a fixed-point image per segment of at most 128 inputs, split into int8
  parts so the products are exact int8 dot products: by default a 16-bit image (scale = max |x| /
  32639, two parts; per-element error below 2^-16 of its segment's largest value, mean KL 5e-8
  against exact on real checkpoints), with ``cfg.exact_float`` a 24-bit one (max |x| / 8355711,
  three parts, error below 2^-24: float32's own, so activation outliers (AWQ) cost the other
  channels nothing).  Not activation quantization in the W4A8 sense: the result tracks float32
  (docs/NATIVE.md).
* ``native_w4a8`` / ``native_w6a8`` / ``native_w8a8``: int8 activations, quantized in C++ with the
  arithmetic of :mod:`quill.kernels.activation` (dynamic per token, or the
  checkpoint's static scale and zero point), exact int32 dot products.  Chosen
  only when the layer's activation is int8: a W8A8 checkpoint's own, or
  ``activation_quant="int8"`` asked by the user.

The ISA variant (AVX-512 or AVX2) is chosen once per layer in ``prepare`` from
``cfg.platform``; threads are ``cfg.threads`` (the run's, from ``LLM(threads=...)``), capped by
``torch.get_num_threads()`` at each call (the same pool torch uses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from quill import native
from quill.canonical import ActivationQuant, QuantizedWeight
from quill.errors import KernelError
from quill.kernels.base import LinearKernel
from quill.kernels.config import ActKind, LinearLayerConfig
from quill.native.pack import INT8_MAX_SEGMENT, PackedWeight, pack
from quill.platform import Platform

# What a saved PackedWeight holds (the prepacked cache): its tensors, and the facts beside them.
PACKED_TENSORS = ("codes", "scales", "zeros", "offsets", "seg_end", "src", "wsum", "hplane", "super_scales",
                  "super_offsets")
PACKED_FACTS = ("bits", "out_features", "in_features", "zconst", "sub_bits", "sub_bias")


@dataclass
class NativeState:
    packed: PackedWeight  # tensors kept alive here (and counted by state_bytes)
    handle: Any  # quill.native._quill_native.NativeLinear
    isa: str

    def set_threads(self, n: int) -> None:
        self.handle.set_threads(n)


def make_handle(packed: PackedWeight, name: str, act: ActivationQuant | None, isa: str, threads: int,
                int8: bool, image_bits: int = 24) -> Any:
    """The C++ NativeLinear over ``packed`` for layer ``name``; ``isa`` is 'avx512', 'avx2' or 'scalar';
    ``image_bits`` the fixed-point image of float activations (24: exact to float32 rounding, or 16)."""
    ext = native.load()
    if ext.module is None:
        raise KernelError(f"{name}: native kernels unavailable: {ext.error}")
    static = act is not None and not act.dynamic
    return ext.module.NativeLinear(
        packed.codes, packed.scales, packed.zeros, packed.offsets, packed.seg_end, packed.src, packed.wsum,
        packed.bits, packed.out_features, packed.in_features, "int8" if int8 else "float", isa,
        act_dynamic=not static, act_symmetric=act is None or act.symmetric,
        act_scale=float(act.scale) if static else 0.0,
        act_zero=float(act.zero_point or 0) if static else 0.0, threads=threads, hplane=packed.hplane,
        super_scales=packed.super_scales, super_offsets=packed.super_offsets,
        zconst=None if packed.zconst is None else float(packed.zconst), sub_bits=packed.sub_bits,
        sub_bias=packed.sub_bias, act_per_segment=act is not None and act.per_group, image_bits=image_bits,
        act_per_super=act is not None and act.per_group and packed.super_scales is not None)


def image_bits(cfg: LinearLayerConfig) -> int:
    """The float activations' image a layer runs with: 24 bits when asked to be exact, else 16."""
    return 24 if cfg.exact_float else 16


# Native code widths and the stored widths each runs (exactly: same codes, zero spelt out).
# 3: 2-bit pair blocks, plus a plane of third bits for 3-bit codes (stored bits).
# 4: 4-bit nibble blocks; 2/3-bit codes widened (the fallback when the w3 kernels are off).
# 6: 4-bit nibble blocks plus a high-bit plane (1 bit for 5-bit codes, 2 for 6-bit).
_WIDENS = {3: (2, 3), 4: (2, 3, 4), 6: (5, 6), 8: (8,)}


def native_width(bits: int) -> int | None:
    """The native code width that runs ``bits``-bit weights first (its own bits where it can), or None."""
    return next((w for w, stored in _WIDENS.items() if bits in stored), None)


class _NativeKernel(LinearKernel):
    bits: ClassVar[int]
    two_level_scales = True  # GGUF K-quants' int8 sub-scales x f16 super-block scales, read as stored
    int8: ClassVar[bool]  # int8 activations (W4A8, W8A8) or float (W4A16, W8A16)

    @classmethod
    def supported(cls, platform: Platform) -> str | None:
        return native.unsupported(platform)

    @classmethod
    def variant(cls, platform: Platform) -> str:
        """The ISA variant ``prepare`` picks on ``platform`` (shown by ``quill info``)."""
        return native.isa_for(platform) or "none"

    @classmethod
    def can_implement(cls, cfg: LinearLayerConfig) -> str | None:
        if cfg.bits not in _WIDENS[cls.bits]:
            return f"runs {'/'.join(map(str, _WIDENS[cls.bits]))}-bit codes, found {cfg.bits}-bit"
        if cls.int8 and cfg.act == ActKind.FLOAT:
            return ("activations are float; int8 activations run only when the checkpoint or "
                    "activation_quant='int8' asks")
        if not cls.int8 and cfg.act != ActKind.FLOAT:
            return f"runs float activations, found {cfg.act.value}"
        limit = INT8_MAX_SEGMENT[cfg.bits]  # the int8 stream's segments: groups cut to keep int32 sums
        if cfg.act == ActKind.INT8_GROUP and cfg.group_size > limit:
            return f"one activation scale per group needs groups of at most {limit} columns, found {cfg.group_size}"
        return None

    @classmethod
    def prepare(cls, weight: QuantizedWeight, cfg: LinearLayerConfig) -> NativeState:
        isa = native.isa_for(cfg.platform)
        if isa is None:
            raise KernelError(f"{weight.name}: {cls.name} needs {native.isa_requirement()}")
        # native_w4*: 2/3-bit codes widened to 4; every other kernel packs the stored bits
        packed = pack(weight.widened(4) if cls.bits == 4 and weight.bits < 4 else weight, cls.int8)
        handle = make_handle(packed, weight.name, weight.activation, isa, cfg.threads, cls.int8, image_bits(cfg))
        return NativeState(packed, handle, isa)

    @classmethod
    def export_state(cls, state: NativeState) -> tuple[dict, dict[str, torch.Tensor]]:
        p = state.packed
        facts = {f: getattr(p, f) for f in PACKED_FACTS}
        tensors = {f: t for f in PACKED_TENSORS if (t := getattr(p, f)) is not None}
        return facts, tensors

    @classmethod
    def restore_state(cls, facts: dict, tensors: dict[str, torch.Tensor], cfg: LinearLayerConfig,
                      activation: ActivationQuant | None, name: str) -> NativeState:
        isa = native.isa_for(cfg.platform)
        if isa is None:
            raise KernelError(f"{name}: {cls.name} needs {native.isa_requirement()}")
        unknown = set(tensors) - set(PACKED_TENSORS)
        if unknown or set(facts) != set(PACKED_FACTS):
            raise KernelError(f"{name}: a saved {cls.name} state has fields {sorted(facts)} and tensors "
                              f"{sorted(tensors)}; expected {list(PACKED_FACTS)} and some of {list(PACKED_TENSORS)}")
        packed = PackedWeight(**{f: tensors.get(f) for f in PACKED_TENSORS}, **facts)
        return NativeState(packed, make_handle(packed, name, activation, isa, cfg.threads, cls.int8, image_bits(cfg)),
                           isa)

    @classmethod
    def apply(cls, state: NativeState, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return state.handle.forward(x, bias)  # x [..., K] -> [..., N]; shapes checked in C++

    @classmethod
    def state_bytes(cls, state: NativeState) -> int:
        return sum(t.numel() * t.element_size() for t in vars(state.packed).values() if isinstance(t, torch.Tensor))


class NativeW3A16Kernel(_NativeKernel):
    name = "native_w3a16"
    bits, int8 = 3, False


class NativeW3A8Kernel(_NativeKernel):
    name = "native_w3a8"
    bits, int8 = 3, True


class NativeW4A16Kernel(_NativeKernel):
    name = "native_w4a16"
    bits, int8 = 4, False


class NativeW6A16Kernel(_NativeKernel):
    name = "native_w6a16"
    bits, int8 = 6, False


class NativeW6A8Kernel(_NativeKernel):
    name = "native_w6a8"
    bits, int8 = 6, True


class NativeW8A16Kernel(_NativeKernel):
    name = "native_w8a16"
    bits, int8 = 8, False


class NativeW4A8Kernel(_NativeKernel):
    name = "native_w4a8"
    bits, int8 = 4, True


class NativeW8A8Kernel(_NativeKernel):
    name = "native_w8a8"
    bits, int8 = 8, True

