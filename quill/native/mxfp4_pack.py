"""Repack an MXFP4 :class:`QuantizedWeight` (FP4 E2M1 codes, E8M0 scales, groups of 32) into the
native MXFP4 layout (``csrc/mxfp4.h``), once, after loading: 4.25 bits per weight, as stored.

    codes  uint8 [NB, G, 4 jj, 16 r, 4 b]  q[16 nb + r][32 g + 4 jj + b] | q[16 nb + r][32 g + 4 jj + b + 16] << 4
    scales uint8 [NB, G, 16 r]               the E8M0 exponent of row 16 nb + r, group g

One 32-bit lane holds 4 consecutive columns of one row (and the 4 sixteen columns on), so a 64-byte
load of a quad ``jj`` is 16 rows x 4 columns: one ``vpdpbusd`` per token and nibble.

Rows are padded to whole blocks of 16 with code 0 (value 0) and exponent 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quill.canonical import E8M0, FP4_E2M1, QuantizedWeight
from quill.errors import KernelError

LANES, GROUP = 16, 32


@dataclass
class PackedMxfp4:
    codes: torch.Tensor  # uint8 [NB, G, 4, 16, 4]
    scales: torch.Tensor  # uint8 [NB, G, 16]
    out_features: int
    in_features: int


def is_mxfp4(w: QuantizedWeight) -> str | None:
    """Why ``w`` is not an MXFP4 weight this layout holds, or None."""
    if w.codebook is None or not torch.equal(w.codebook, FP4_E2M1):
        return "codes are not FP4 E2M1 codebook codes"
    if w.scales.dtype != E8M0:
        return f"scales are {w.scales.dtype}, not E8M0"
    if w.group_size != GROUP or w.in_features % GROUP:
        return f"groups of {w.group_size} over {w.in_features} columns; needs groups of 32"
    return None


def pack_mxfp4(w: QuantizedWeight) -> PackedMxfp4:
    why = is_mxfp4(w)
    if why:
        raise KernelError(f"{w.name}: cannot pack as MXFP4: {why}")
    n, k = w.out_features, w.in_features
    nb, g = -(-n // LANES), k // GROUP
    codes, scales = w.codes, w.scales.view(torch.uint8)
    if nb * LANES != n:
        codes = torch.cat([codes, codes.new_zeros(nb * LANES - n, k)])
        scales = torch.cat([scales, scales.new_zeros(nb * LANES - n, g)])
    q = codes.view(nb, LANES, g, 2, 4, 4)  # [nb, r, g, half, jj, b]: column 32 g + 16 half + 4 jj + b
    packed = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).contiguous()  # [nb, g, jj, r, b]
    return PackedMxfp4(packed, scales.view(nb, LANES, g).transpose(1, 2).contiguous(), n, k)
