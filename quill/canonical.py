"""The canonical quantized weight: the one description every format converts into.

Formats convert *into* :class:`QuantizedWeight` (one converter each) and kernels
repack *out of* it (one ``prepare`` each), so formats x kernels stays N + M.
A leaf: it imports torch and quill.errors only, so a kernel that needs the
canonical weight loads no format; a weight is frozen once built (``with_`` copies).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from quill.errors import CheckpointError, ConfigError, UnsupportedFormatError

SUPPORTED_BITS = (2, 3, 4, 8)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ActivationQuant:
    """How a layer's *input* is quantized to integers at run time (W8A8, W4A8).

    ``dynamic=True``: one scale per token (row of the input), computed at run
    time from the row itself.  ``dynamic=False``: one static scale (and zero
    point, if asymmetric) for the whole tensor, read from the checkpoint.

    The exact arithmetic lives in :mod:`quill.kernels.activation`; it follows
    compressed-tensors (scale = amax / 127.5 symmetric, round half to even,
    clamp to [-128, 127]).
    """

    bits: int = 8
    dynamic: bool = True
    symmetric: bool = True
    scale: float | None = None  # static only
    zero_point: int | None = None  # static asymmetric only

    def __post_init__(self):
        if self.bits != 8:
            raise UnsupportedFormatError(
                f"activation quantization to {self.bits} bits is not supported; supported: 8"
            )
        if not self.dynamic and self.scale is None:
            raise ConfigError("static activation quantization needs an input scale, found none")
        if self.dynamic and (self.scale is not None or self.zero_point is not None):
            raise ConfigError("dynamic activation quantization cannot carry a static scale or zero point")
        if self.symmetric and self.zero_point not in (None, 0):
            raise ConfigError(f"symmetric activation quantization has zero point {self.zero_point}, expected 0 or none")


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A linear layer's quantized weight in logical orientation ``[out_features, in_features]``.

    Dequantization, the one formula every format and kernel agrees on::

        g          = g_idx[i]            if g_idx is not None
                     i // group_size     otherwise
        z[o, g]    = zeros[o, g]         if zeros is not None   (asymmetric)
                     2 ** (bits - 1)     otherwise              (symmetric)
        w[o, i]    = (codes[o, i] - z[o, g]) * scales[o, g]  (+ offsets[o, g] if offsets is not None)

    computed in float32 (scales upcast from their stored dtype), which makes it
    exact for every format quill reads: ``codes - z`` is a small integer and the
    product with a 16-bit scale is representable in float32.

    Fields:
        codes:   uint8 [out, in], unsigned integer codes in [0, 2**bits).
        bits:    2, 3, 4 or 8.
        group_size: input columns per scale group; ``in_features`` for per-channel.
        scales:  float [out, G] in the checkpoint's dtype (may be negative:
                 auto-round's symmetric RTN produces negative scales).
        zeros:   int16 [out, G] integer zero points in [0, 2**bits], or None (symmetric).
        offsets: float [out, G] added after scaling (GGUF Q4_1's ``min``), or None.
        g_idx:   int32 [in], act-order group of each input column, or None.
        dtype:   the model's original float dtype (what the weight was quantized from).
        bias:    float [out] or None.
        activation: the input quantization the checkpoint prescribes (W8A8), or None.
    """

    codes: torch.Tensor
    bits: int
    group_size: int
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    dtype: torch.dtype = torch.bfloat16
    bias: torch.Tensor | None = None
    activation: ActivationQuant | None = None
    name: str = field(default="<unnamed>", compare=False)

    # ---- shape facts -------------------------------------------------
    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def num_groups(self) -> int:
        return self.scales.shape[1]

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def has_act_order(self) -> bool:
        return self.g_idx is not None

    @property
    def per_channel(self) -> bool:
        return self.group_size == self.in_features

    def group_index(self) -> torch.Tensor:
        """int64 [in]: the scale group of every input column."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features) // self.group_size

    def storage_bytes(self) -> int:
        """Bytes this weight occupies when packed: codes at ``bits`` each, plus scales/zeros/offsets."""
        n = self.out_features * self.in_features * self.bits // 8
        n += self.scales.numel() * self.scales.element_size()
        if self.zeros is not None:
            n += (self.zeros.numel() * self.bits + 7) // 8
        if self.offsets is not None:
            n += self.offsets.numel() * self.offsets.element_size()
        return n

    # ---- the formula -------------------------------------------------
    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], computed exactly as the class docstring says."""
        g = self.group_index()
        w = self.codes.to(torch.float32)
        if self.zeros is None:
            w = w - float(1 << (self.bits - 1))
        else:
            w = w - self.zeros.to(torch.float32)[:, g]
        w = w * self.scales.to(torch.float32)[:, g]
        if self.offsets is not None:
            w = w + self.offsets.to(torch.float32)[:, g]
        return w

    def with_(self, **changes) -> "QuantizedWeight":
        """A copy with some fields replaced (dataclasses.replace)."""
        return replace(self, **changes)

    # ---- consistency -------------------------------------------------
    def validate(self) -> "QuantizedWeight":
        """Check every field against the others; raise a typed error naming the layer."""
        n = self.name
        if self.bits not in SUPPORTED_BITS:
            raise UnsupportedFormatError(f"{n}: bits={self.bits} is not supported; supported: {list(SUPPORTED_BITS)}")
        _expect(self.codes.dtype == torch.uint8 and self.codes.dim() == 2, n, "codes",
                f"uint8 [out, in], found {self.codes.dtype} {list(self.codes.shape)}")
        out, inp = self.codes.shape
        if self.group_size <= 0 or inp % self.group_size:
            raise ConfigError(
                f"{n}: group_size {self.group_size} does not divide in_features {inp}; "
                "supported: a positive divisor of in_features (or per-channel)")
        _expect(self.scales.dtype in FLOAT_DTYPES and self.scales.dim() == 2 and self.scales.shape[0] == out,
                n, "scales", f"float [out={out}, G], found {self.scales.dtype} {list(self.scales.shape)}")
        groups = self.scales.shape[1]
        if self.g_idx is None and groups != inp // self.group_size:
            raise CheckpointError(
                f"{n}: scales have {groups} groups but in_features {inp} / group_size {self.group_size} "
                f"= {inp // self.group_size}")
        if self.zeros is not None:
            _expect(self.zeros.dtype == torch.int16 and tuple(self.zeros.shape) == (out, groups), n, "zeros",
                    f"int16 [{out}, {groups}], found {self.zeros.dtype} {list(self.zeros.shape)}")
        if self.offsets is not None:
            _expect(self.offsets.dtype in FLOAT_DTYPES and tuple(self.offsets.shape) == (out, groups), n,
                    "offsets", f"float [{out}, {groups}], found {self.offsets.dtype} {list(self.offsets.shape)}")
        if self.g_idx is not None:
            _expect(self.g_idx.dtype == torch.int32 and tuple(self.g_idx.shape) == (inp,), n, "g_idx",
                    f"int32 [{inp}], found {self.g_idx.dtype} {list(self.g_idx.shape)}")
            if inp and (int(self.g_idx.min()) < 0 or int(self.g_idx.max()) >= groups):
                raise CheckpointError(
                    f"{n}: g_idx values span [{int(self.g_idx.min())}, {int(self.g_idx.max())}], "
                    f"expected group indices in [0, {groups})")
        if self.bias is not None:
            _expect(self.bias.dtype in FLOAT_DTYPES and tuple(self.bias.shape) == (out,), n, "bias",
                    f"float [{out}], found {self.bias.dtype} {list(self.bias.shape)}")
        if self.codes.numel() and int(self.codes.max()) >= (1 << self.bits):
            raise CheckpointError(
                f"{n}: codes reach {int(self.codes.max())}, above the {self.bits}-bit maximum {(1 << self.bits) - 1}")
        return self


def _expect(ok: bool, layer: str, tensor: str, what: str) -> None:
    if not ok:
        raise CheckpointError(f"{layer}: tensor '{tensor}' should be {what}")
