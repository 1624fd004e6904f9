"""Kernels for the layers a checkpoint left unquantized (lm_head, ``ignore``-d layers, dense MoE experts).

The same shape as the linear kernels: a frozen :class:`DenseLayerConfig`, kernels answering
``supported(platform)`` / ``can_implement(cfg)`` with a reason or None, a priority list per
ISA level, and a selector that records every refusal.  Two kernels:

* ``native_dense``: the native kernel over the weight's exact 16-bit words (bfloat16 or
  float16, or float32 values that are such numbers, e.g. a bf16 embedding tied as lm_head),
  float32 products and sums: a float32 matmul up to summation order, reading half the bytes.
* ``dense``: ``F.linear`` on the weight in the compute dtype (exact against float32 references).

Its policy follows the linear kernels' (``DenseSelector.for_linear``): disabling a native
float-activation kernel (native_w4a16 / native_w8a16), or forcing a kernel that is not one,
keeps dense layers on torch, so ``QUILL_KERNEL=torch`` still means "no native code".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from quill.kernels.priority import KernelPolicy, PrioritySelector, Registry
from quill.platform import Platform

DENSE_KERNELS_BY_NAME: dict[str, str] = {
    "native_dense": "quill.kernels.dense:NativeDenseKernel",
    "dense": "quill.kernels.dense:TorchDenseKernel",
}
DENSE_PRIORITIES: dict[str, tuple[str, ...]] = {
    "avx2": ("native_dense", "dense"),  # and every level above
    "scalar": ("dense",),
}
# no variables of its own: the linear kernels' policy decides (DenseSelector.for_linear)
_POLICY = "the linear kernel policy (QUILL_KERNEL / QUILL_DISABLED_KERNELS)"
DENSE_KERNELS = Registry("dense kernel", DENSE_KERNELS_BY_NAME, DENSE_PRIORITIES, _POLICY, _POLICY, "quill.kernels")

# The native dense kernel goes with the native float-activation linear kernels.
NATIVE_FLOAT_KERNELS = ("native_w3a16", "native_w4a16", "native_w6a16", "native_w8a16")


def as_16bit(w: torch.Tensor, rows: int = 4096) -> torch.Tensor | None:
    """``w`` as bfloat16 or float16 when that holds every value exactly (checked a slice of rows at a time)."""
    if w.dtype in (torch.bfloat16, torch.float16):
        return w
    if w.dtype != torch.float32 or w.dim() != 2:
        return None
    for half in (torch.bfloat16, torch.float16):
        if all(torch.equal(w[r:r + rows].to(half).float(), w[r:r + rows]) for r in range(0, w.shape[0], rows)):
            return w.to(half)
    return None


@dataclass(frozen=True)
class DenseLayerConfig:
    """What a dense kernel needs to decide whether it can run a layer."""

    in_features: int
    out_features: int
    stored: torch.dtype  # the weight's dtype as the checkpoint holds it
    exact_16bit: torch.dtype | None  # bfloat16 / float16 when every value is such a number, else None
    compute: torch.dtype
    platform: Platform
    threads: int = 1

    def summary(self) -> str:
        return f"dense {str(self.stored).removeprefix('torch.')} {self.out_features}x{self.in_features}"


class TorchDenseKernel:
    name: ClassVar[str] = "dense"

    @classmethod
    def supported(cls, platform: Platform) -> str | None:
        return None

    @classmethod
    def can_implement(cls, cfg: DenseLayerConfig) -> str | None:
        return None


class NativeDenseKernel:
    name: ClassVar[str] = "native_dense"

    @classmethod
    def supported(cls, platform: Platform) -> str | None:
        from quill import native
        return native.unsupported(platform)

    @classmethod
    def can_implement(cls, cfg: DenseLayerConfig) -> str | None:
        if cfg.exact_16bit is None:
            return "holds exact bfloat16 / float16 words only; this weight has float32 values that are neither"
        return None

    @classmethod
    def pack(cls, half: torch.Tensor) -> torch.Tensor:
        """``half`` [out, in] (bfloat16 / float16) -> the kernel's words int16 [NB, KP, 16, 2] (pack_dense)."""
        from quill.native.pack import pack_dense
        return pack_dense(half.contiguous())

    @classmethod
    def from_packed(cls, words: torch.Tensor, half_dtype: torch.dtype, cfg: DenseLayerConfig) -> Any:
        """The C++ NativeDense over ``words`` (from :meth:`pack`, or read back from a prepacked cache)."""
        from quill import native
        dtype = "bfloat16" if half_dtype == torch.bfloat16 else "float16"
        return native.load().module.NativeDense(words, cfg.out_features, cfg.in_features, dtype,
                                                native.isa_for(cfg.platform), cfg.threads)


@dataclass
class DenseSelector(PrioritySelector):
    """Chooses a dense kernel per layer; logs each distinct choice once."""

    registry: ClassVar[Registry] = DENSE_KERNELS

    @classmethod
    def for_linear(cls, platform: Platform, linear_policy: KernelPolicy, threads: int) -> "DenseSelector":
        """The dense selector that goes with a linear-kernel policy (see the module docstring)."""
        off = any(k in linear_policy.disabled for k in NATIVE_FLOAT_KERNELS) or \
            linear_policy.force not in (None,) + NATIVE_FLOAT_KERNELS
        return cls(platform, KernelPolicy(disabled=frozenset({"native_dense"}) if off else frozenset()),
                   threads=threads)
