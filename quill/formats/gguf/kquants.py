"""GGUF 5-bit and K-quant blocks -> the canonical :class:`QuantizedWeight`.

On-disk layouts (ggml-common.h; ``f16`` is an IEEE half, all little-endian). One row of
``ne[0]`` weights is ``ne[0] / block`` consecutive blocks.

32-weight blocks, one f16 scale ``d`` (and ``m``) per block::

    Q5_0  { f16 d;        u8 qh[4]; u8 qs[16]; }   w = (q - 16) * d
    Q5_1  { f16 d; f16 m; u8 qh[4]; u8 qs[16]; }   w = q * d + m

    q[i] = nibble | bit i of the little-endian u32 qh << 4, where weight j < 16 is
    the low nibble of qs[j] and weight j + 16 its high nibble.

    IQ4_NL { f16 d; u8 qs[16]; }   w = d * KVALUES[q],  q 4-bit, same nibble order:
    a non-linear 16-entry codebook of integers in [-127, 113] (llama.cpp writes it
    for rows a K-quant cannot tile, e.g. Q2_K / Q3_K mixes of 576-wide models).

K-quants: super-blocks of 256 weights, sub-blocks of 16 or 32 with small integer
sub-scales multiplied by the super-block's f16 ``d`` (and ``dmin``)::

    Q2_K  { u8 scales[16]; u8 qs[64]; f16 d; f16 dmin; }            16 x 16
          sub-block s: sc = scales[s] & 15, m = scales[s] >> 4
          w = d*sc * q - dmin*m,  q 2-bit
    Q3_K  { u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d; }         16 x 16
          6-bit signed sub-scales sc - 32: low 4 bits in scales[0..7] (sub-blocks
          0..7 low nibbles, 8..15 high nibbles), high 2 bits of sub-block s in
          scales[8 + s % 4] >> 2 * (s // 4)
          w = d*(sc - 32) * (q - 4),  q = 2 low bits | hmask bit << 2
    Q4_K  { f16 d; f16 dmin; u8 scales[12]; u8 qs[128]; }           8 x 32
    Q5_K  { f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]; } 8 x 32
          packed 6-bit (sc, m) of sub-block s (get_scale_min_k4):
            s < 4:  sc = scales[s] & 63,  m = scales[s + 4] & 63
            s >= 4: sc = scales[s + 4] & 15 | (scales[s - 4] >> 6) << 4,
                    m  = scales[s + 4] >> 4 | (scales[s]     >> 6) << 4
          w = d*sc * q - dmin*m,  q 4-bit (Q5_K: | bit s of qh[l] << 4)
    Q6_K  { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d; }           16 x 16
          w = d*sc * (q - 32),  q = 4 low bits | 2 high bits << 4

Bit positions inside a super-block: Q2_K / Q3_K take weight ``128h + 32j + b``
from bits ``2j`` of qs[32h + b] (Q3_K's high bit: bit ``4h + j`` of hmask[b]);
Q4_K / Q5_K take weight ``64c + 32n + l`` from nibble ``n`` of qs[32c + l] (Q5_K's
high bit: bit ``2c + n`` of qh[l]); Q6_K takes weight ``128h + 32k + l`` from
nibble ``k // 2`` of ql[64h + 32(k % 2) + l] and bits ``2k`` of qh[32h + l].

Canonical forms, exact because ggml and gguf-py compute ``d*sc`` (an f16 times a
small integer, exact in float32), then one product with the code and one
subtraction, which is the canonical formula's order:

* Q5_0: codes q (5-bit), symmetric (implicit zero 16), scales d.
* IQ4_NL: codes KVALUES[q] + 128 (8-bit), symmetric (implicit zero 128), scales d: the
  codebook value is the integer ``code - 128`` (8 bits in canonical form for 4 stored).
* Q5_1: codes q, zeros 0, scales d, offsets m.
* Q2_K / Q4_K / Q5_K: codes q, zeros 0, two-level scales (super_scales d, scales
  sc) and offsets (super_offsets -dmin, offsets m): ``q*(d*sc) + (-dmin)*m``.
* Q3_K: codes q (3-bit), symmetric (implicit zero 4), super_scales d, scales sc - 32.
* Q6_K: codes q (6-bit), symmetric (implicit zero 32), super_scales d, scales sc.
"""

from __future__ import annotations

import torch

from quill.canonical import QuantizedWeight
from quill.formats.gguf.blocks import flat, half_field, nibbles


def _bits(x: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """uint8 [..., n] -> [..., len(shifts), n]: ``(x >> s) & mask`` for every shift."""
    out = torch.empty(*x.shape[:-1], len(shifts), x.shape[-1], dtype=torch.uint8)
    for i, s in enumerate(shifts):
        torch.bitwise_and(torch.bitwise_right_shift(x, s), mask, out=out[..., i, :])
    return out


def _qh32(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1 high bits: uint8 [R, B, 4] -> uint8 [R, B, 32], bit i of the u32 for weight i."""
    return _bits(qh, tuple(range(8)), 1).transpose(-1, -2).reshape(*qh.shape[:-1], 32)


def _q5_codes(blocks: torch.Tensor, qh_at: int) -> torch.Tensor:
    qs = blocks[..., qh_at + 4:qh_at + 20]
    return flat(nibbles(qs) | (_qh32(blocks[..., qh_at:qh_at + 4]) << 4))


def q5_0(blocks: torch.Tensor, name: str) -> QuantizedWeight:
    """blocks uint8 [out, in / 32, 22]."""
    return QuantizedWeight(codes=_q5_codes(blocks, 2), bits=5, group_size=32, scales=half_field(blocks, 0),
                           dtype=torch.float32, name=name)


def q5_1(blocks: torch.Tensor, name: str) -> QuantizedWeight:
    """blocks uint8 [out, in / 32, 24]."""
    d, m = half_field(blocks, 0), half_field(blocks, 2)
    return QuantizedWeight(codes=_q5_codes(blocks, 4), bits=5, group_size=32, scales=d,
                           zeros=torch.zeros(d.shape, dtype=torch.int16), offsets=m,
                           dtype=torch.float32, name=name)


KVALUES_IQ4NL = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                             dtype=torch.int16)


def iq4_nl(blocks: torch.Tensor, name: str) -> QuantizedWeight:
    """blocks uint8 [out, in / 32, 18]."""
    q = flat(nibbles(blocks[..., 2:18]))  # [R, in]
    codes = (KVALUES_IQ4NL[q.long()] + 128).to(torch.uint8)
    return QuantizedWeight(codes=codes, bits=8, group_size=32, scales=half_field(blocks, 0), dtype=torch.float32,
                           name=name)


def _scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K packed scales uint8 [R, B, 12] -> (sc, m) int8 [R, B, 8] each."""
    lo = torch.cat([sc[..., 0:4] & 63, (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)], dim=-1)
    mn = torch.cat([sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], dim=-1)
    return lo.to(torch.int8), mn.to(torch.int8)


def _two_level(codes, bits, group, d, sub, dmin=None, mins=None, name="") -> QuantizedWeight:
    """Canonical weight from per-super-block d (dmin) [R, B] and integer sub-scales (mins) [R, B, n]."""
    kw = {}
    if dmin is not None:  # w = q*(d*sc) - dmin*m  ==  q*(d*sc) + (-dmin)*m, bit for bit
        zeros = torch.zeros(1, 1, dtype=torch.int16).expand(sub.shape[0], sub.shape[1] * sub.shape[2])  # no copy
        kw = dict(zeros=zeros, offsets=flat(mins), super_offsets=-dmin)
    return QuantizedWeight(codes=codes, bits=bits, group_size=group, scales=flat(sub), super_scales=d,
                           dtype=torch.float32, name=name, **kw)


def q2_k(blocks: torch.Tensor, name: str) -> QuantizedWeight:
    """blocks uint8 [out, in / 256, 84]."""
    sc, qs = blocks[..., 0:16], blocks[..., 16:80]
    codes = _bits(qs.unflatten(-1, (2, 32)), (0, 2, 4, 6), 3)  # [R, B, 2 halves, 4 shifts, 32]
    return _two_level(flat(codes), 2, 16, half_field(blocks, 80), (sc & 15).to(torch.int8),
                      half_field(blocks, 82), (sc >> 4).to(torch.int8), name)


def _q3_scales(sc: torch.Tensor) -> torch.Tensor:
    """Q3_K packed scales uint8 [R, B, 12] -> signed sub-scales int8 [R, B, 16]."""
    low = torch.cat([sc[..., 0:8] & 15, sc[..., 0:8] >> 4], dim=-1)  # [R, B, 16]
    high = _bits(sc[..., 8:12], (0, 2, 4, 6), 3).flatten(-2)  # sub-block s: shift 2 * (s // 4), byte s % 4
    return (low | (high << 4)).to(torch.int8) - 32


def q3_k(blocks: torch.Tensor, name: str) -> QuantizedWeight:
    """blocks uint8 [out, in / 256, 110]."""
    hmask, qs = blocks[..., 0:32], blocks[..., 32:96]
    low = _bits(qs.unflatten(-1, (2, 32)), (0, 2, 4, 6), 3)  # [R, B, 2, 4, 32]
    high = _bits(hmask, tuple(range(8)), 1).unflatten(-2, (2, 4))  # bit 4h + j of hmask[b]
    codes = low | (high << 2)
    return _two_level(flat(codes), 3, 16, half_field(blocks, 108), _q3_scales(blocks[..., 96:108]), name=name)


def q4_k(blocks: torch.Tensor, name: str) -> QuantizedWeight:
    """blocks uint8 [out, in / 256, 144]."""
    sc, mn = _scale_min_k4(blocks[..., 4:16])
    qs = blocks[..., 16:144].unflatten(-1, (4, 32))  # [R, B, 4 chunks, 32]
    codes = _bits(qs, (0, 4), 15)  # [R, B, 4, 2 nibbles, 32]
    return _two_level(flat(codes), 4, 32, half_field(blocks, 0), sc, half_field(blocks, 2), mn, name)


def q5_k(blocks: torch.Tensor, name: str) -> QuantizedWeight:
    """blocks uint8 [out, in / 256, 176]."""
    sc, mn = _scale_min_k4(blocks[..., 4:16])
    qs = blocks[..., 48:176].unflatten(-1, (4, 32))
    low = _bits(qs, (0, 4), 15)  # [R, B, 4, 2, 32]
    high = _bits(blocks[..., 16:48], tuple(range(8)), 1).unflatten(-2, (4, 2))  # bit 2c + n of qh[l]
    return _two_level(flat(low | (high << 4)), 5, 32, half_field(blocks, 0), sc, half_field(blocks, 2), mn, name)


def q6_k(blocks: torch.Tensor, name: str) -> QuantizedWeight:
    """blocks uint8 [out, in / 256, 210]."""
    ql = blocks[..., 0:128].unflatten(-1, (2, 2, 32))  # [R, B, half, k % 2, 32]
    qh = blocks[..., 128:192].unflatten(-1, (2, 32))  # [R, B, half, 32]
    low = _bits(ql, (0, 4), 15).transpose(-2, -3).flatten(-3, -2)  # [R, B, half, k = 2 * nibble + k % 2, 32]
    high = _bits(qh, (0, 2, 4, 6), 3)  # [R, B, half, k, 32]
    sc = blocks[..., 192:208].contiguous().view(torch.int8)
    return _two_level(flat(low | (high << 4)), 6, 16, half_field(blocks, 208), sc, name=name)


CONVERTERS = {"Q5_0": q5_0, "Q5_1": q5_1, "IQ4_NL": iq4_nl,
              "Q2_K": q2_k, "Q3_K": q3_k, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}
