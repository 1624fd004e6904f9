"""Canonical weight -> GPTQ tensors (v1 or v2 zero points): the inverse of quill.formats.gptq."""

from __future__ import annotations

import torch

from quill.canonical import QuantizedWeight
from quill.errors import UnsupportedFormatError
from quill.formats.gptq import _ONES
from quill.formats.packing import pack_int32


def canonical_to_gptq(qw: QuantizedWeight, v1: bool = True, write_g_idx: bool = True) -> dict[str, torch.Tensor]:
    """The GPTQ tensors of one layer (suffix -> tensor), inverse of :func:`gptq_to_canonical`.

    ``write_g_idx`` writes the trivial g_idx too (as auto-round does); an
    act-order weight always gets its g_idx.
    """
    if qw.offsets is not None:
        raise UnsupportedFormatError(f"{qw.name}: GPTQ cannot store float offsets (GGUF-style minimums)")
    bits, mid = qw.bits, 1 << (qw.bits - 1)
    zeros = qw.zeros if qw.zeros is not None else torch.full(tuple(qw.scales.shape), mid, dtype=torch.int16)
    lo, hi = (0, (1 << bits) - 1)
    if zeros.numel() and (int(zeros.min()) < lo or int(zeros.max()) > hi):
        raise UnsupportedFormatError(
            f"{qw.name}: zero points span [{int(zeros.min())}, {int(zeros.max())}]; GPTQ stores {bits}-bit "
            f"zero points in [{lo}, {hi}]")
    out = {
        "qweight": pack_int32(qw.codes, bits, dim=1).T.contiguous(),  # [K*b/32, N]
        "qzeros": _pack_zeros(zeros.T.contiguous(), bits, v1),  # [G, N*b/32]
        "scales": qw.scales.T.contiguous(),  # [G, N]
    }
    if qw.g_idx is not None or write_g_idx:
        out["g_idx"] = qw.group_index().to(torch.int32)
    if qw.bias is not None:
        out["bias"] = qw.bias
    return out


def _pack_zeros(zeros: torch.Tensor, bits: int, v1: bool) -> torch.Tensor:
    if not v1:
        return pack_int32(zeros, bits, dim=1)
    if bits not in _ONES:
        return pack_int32((zeros.to(torch.int64) - 1) % (1 << bits), bits, dim=1)
    words = (pack_int32(zeros, bits, dim=1).to(torch.int64) - _ONES[bits]) & 0xFFFFFFFF
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
