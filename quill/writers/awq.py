"""Canonical weight -> AutoAWQ GEMM tensors: the inverse of quill.formats.awq (tests and benchmarks)."""

from __future__ import annotations

import torch

from quill.canonical import QuantizedWeight
from quill.errors import UnsupportedFormatError
from quill.formats.awq import AWQ_BITS, AWQ_ORDER
from quill.formats.packing import pack_int32


def canonical_to_awq(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The AWQ-GEMM tensors of one layer (suffix -> tensor), inverse of :func:`awq_to_canonical`."""
    if qw.bits not in AWQ_BITS:
        raise UnsupportedFormatError(f"{qw.name}: AWQ GEMM stores 4-bit codes, not {qw.bits}-bit")
    if qw.g_idx is not None or qw.offsets is not None:
        raise UnsupportedFormatError(f"{qw.name}: AWQ cannot store act-order (g_idx) or float offsets")
    if qw.out_features % 8:
        raise UnsupportedFormatError(f"{qw.name}: AWQ packs 8 output columns per int32; out_features "
                                     f"{qw.out_features} is not a multiple of 8")
    zeros = qw.zeros if qw.zeros is not None else torch.full(tuple(qw.scales.shape), 8, dtype=torch.int16)
    if zeros.numel() and int(zeros.max()) > 15:
        raise UnsupportedFormatError(f"{qw.name}: zero point {int(zeros.max())} does not fit AWQ's 4 bits")
    out = {
        "qweight": pack_int32(qw.codes.T, 4, dim=1, order=AWQ_ORDER),  # [K, N/8]
        "qzeros": pack_int32(zeros.T, 4, dim=1, order=AWQ_ORDER),  # [G, N/8]
        "scales": qw.scales.T.contiguous(),  # [G, N]
    }
    if qw.bias is not None:
        out["bias"] = qw.bias
    return out
