"""Repack a canonical :class:`QuantizedWeight` into the native kernels' layout.

The layout is described in ``csrc/common.h``.  In short: output rows in blocks
of 16 (one per SIMD lane), input columns reordered into a *stream* (act-order
groups made contiguous, every segment padded with zeros to whole chunks of 16
(2/3-bit), 8 (4-6 bit) or 4 (8-bit) positions), one 64-byte block per chunk and
row block (5/6-bit codes: their low 4 bits, with a high-bit plane of 16 or 32 bytes
beside it; 3-bit codes: their low 2 bits, with a 32-byte plane of third bits), and
one scale (zero, offset) per segment and row, or for two-level scales an integer per
segment (int8, or packed in 4 / 6 bits for 2/3-bit codes, as GGUF Q2_K / Q3_K store
them) and a float per super-block.  Done once, after loading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quill import native
from quill.canonical import QuantizedWeight
from quill.errors import KernelError

LANES = 16
BLOCK_BYTES = 64

# Longest segment (positions; longer groups are cut, each piece with the group's scale).
# int8 activations: int32 sums of 8-bit codes stay exact up to 2**31 / (255 * 128)
# positions.  Float activations: every segment has its own activation scale (the
# fixed-point image, csrc/common.h SplitActs), so pieces of 128 bound its error to a
# 128-wide neighbourhood and keep sums of 8-bit codes within int32.
INT8_MAX_SEGMENT = {8: 32768, 6: 1 << 20, 5: 1 << 20, 4: 1 << 20, 3: 1 << 20, 2: 1 << 20}
FLOAT_MAX_SEGMENT = 128


def chunk_k(bits: int) -> int:
    return 4 if bits == 8 else (16 if bits <= 3 else 8)


def plane_bytes(bits: int) -> int:
    """Bytes of the high-bit plane per chunk and row block (csrc/common.h)."""
    return 32 if bits == 3 else (16 * (bits - 4) if bits in (5, 6) else 0)



@dataclass(frozen=True)
class StreamOrder:
    """Where every stream position comes from, and how positions form segments."""

    src: torch.Tensor | None  # int64 [Kp]: source column (-1 = zero padding); None = identity + end padding
    kp: int
    seg_group: torch.Tensor  # int64 [S]: quantization group of every segment
    seg_end: torch.Tensor  # int32 [S]: exclusive end of every segment, in chunks


def _group_columns(w: QuantizedWeight) -> list[torch.Tensor]:
    """int64 column indices of every group, in stream order (act-order: sorted by group, stable)."""
    if w.g_idx is None:
        return list(torch.arange(w.in_features).split(w.group_size))
    order, counts = w.group_order()
    return list(order.split(counts.tolist()))


def stream_order(w: QuantizedWeight, max_segment: int | None = None) -> StreamOrder:
    """Stream order of ``w``'s input columns: groups contiguous, segments padded to whole chunks."""
    chunk = chunk_k(w.bits)
    if max_segment is not None and max_segment % chunk:
        raise KernelError(f"{w.name}: segment limit {max_segment} is not a multiple of the chunk {chunk}")
    pieces, groups, ends, pos = [], [], [], 0
    for g, cols in enumerate(_group_columns(w)):
        step = max_segment or max(len(cols), 1)
        for part in cols.split(step):  # empty groups produce no segment
            pad = -len(part) % chunk
            pieces.append(torch.cat([part, torch.full((pad,), -1, dtype=torch.long)]) if pad else part)
            groups.append(g)
            pos += len(part) + pad
            ends.append(pos // chunk)
    src = torch.cat(pieces)
    k = w.in_features
    identity = bool((src[:k] == torch.arange(k)).all()) and bool((src[k:] == -1).all())
    return StreamOrder(None if identity else src.contiguous(), len(src), torch.tensor(groups, dtype=torch.long),
                       torch.tensor(ends, dtype=torch.int32))


@dataclass
class PackedWeight:
    """The native layout of one layer (tensors the C++ NativeLinear keeps views of)."""

    codes: torch.Tensor  # uint8 [NB, KC, 64]
    scales: torch.Tensor  # float32/float16/bfloat16 [NB, S, 16]; int8 with super_scales
    zeros: torch.Tensor | None  # uint8 (4-6 bit) / int16 (8-bit) [NB, S, 16]; None: zconst
    offsets: torch.Tensor | None  # scales' dtype [NB, S, 16]; int8 with super_offsets
    seg_end: torch.Tensor  # int32 [S]
    src: torch.Tensor | None  # int64 [Kp]
    wsum: torch.Tensor | None  # float32 [NB * 16]: row sums of the dequantized weight
    bits: int
    out_features: int
    in_features: int
    hplane: torch.Tensor | None = None  # uint8 [NB, KC, 16 * (bits - 4)] (5/6-bit)
    super_scales: torch.Tensor | None = None  # float [NB, S / GPS, 16] (two-level)
    super_offsets: torch.Tensor | None = None  # float [NB, S / GPS, 16] (two-level)
    zconst: int | None = None  # the one zero point when zeros is None (None: 2**(bits-1))
    sub_bits: int = 8  # two-level sub-values: int8 [NB, S, 16], or packed 4 / 6 bits uint8 [NB, SR, 16]
    sub_bias: int = 0  # packed sub-values: value = stored - sub_bias


def _per_lane(t: torch.Tensor, nb: int) -> torch.Tensor:
    """[N, C] -> [NB, C, 16] view: one value per column and lane, padded rows zero."""
    if nb * LANES != t.shape[0]:
        t = torch.cat([t, t.new_zeros(nb * LANES - t.shape[0], t.shape[1])])
    return t.view(nb, LANES, -1).transpose(1, 2)


def _per_segment(t: torch.Tensor, order: StreamOrder, nb: int) -> torch.Tensor:
    """[N, G] -> [NB, S, 16] view: one value per segment and lane."""
    return _per_lane(t[:, order.seg_group], nb)


def _stream_codes(w: QuantizedWeight, order: StreamOrder, nb: int) -> torch.Tensor:
    """uint8 [N, K] codes -> a [NB, 16 lanes, KC, CK] view in stream order, padded with zeros.

    Copies are made only where needed (reordering, padding, nibble packing): a large
    layer's transient memory is what bounds the peak while a model loads.
    """
    codes = w.codes
    if order.src is not None:
        codes = codes[:, order.src.clamp(min=0)]
        codes[:, order.src < 0] = 0
    elif order.kp != w.in_features:
        codes = torch.nn.functional.pad(codes, (0, order.kp - w.in_features))
    if nb * LANES != w.out_features:
        codes = torch.nn.functional.pad(codes, (0, 0, 0, nb * LANES - w.out_features))  # [Np, Kp]
    chunk = chunk_k(w.bits)
    return codes.view(nb, LANES, order.kp // chunk, chunk)


def _codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[NB, 16, KC, CK] stream codes -> a [NB, KC, 16 lanes, 4 bytes] view of the blocks (made contiguous
    by the caller); 5/6-bit codes give their low 4 bits, 3-bit codes their low 2 (the rest goes to the
    high plane)."""
    if bits <= 3:  # byte b of a lane: positions 4j + b at bits 2j, j < 4
        low = q & 3 if bits == 3 else q
        out = low[..., 0:4].clone()
        for j in range(1, 4):
            out.bitwise_or_(low[..., 4 * j:4 * j + 4] << (2 * j))
        return out.permute(0, 2, 1, 3)
    if bits != 8:  # byte b of a lane: positions b (low nibble) and b + 4 (high nibble)
        low = q & 0x0F if bits > 4 else q
        hi = low[..., 4:] << 4
        q = hi.bitwise_or_(low[..., :4])
    return q.permute(0, 2, 1, 3)  # [NB, KC, 16, 4]


def _third_plane(q: torch.Tensor) -> torch.Tensor:
    """[NB, 16, KC, 16] 3-bit stream codes -> the plane of third bits uint8 [NB, KC, 32] (csrc/common.h):
    lane r's bit of position 4j + b in byte 4 * (r % 8) + b at bit 4 * (r / 8) + j."""
    nb, _, kc, _ = q.shape
    high = (q >> 2).permute(0, 2, 1, 3).reshape(nb, kc, 2, 8, 4, 4)  # [NB, KC, r / 8, r % 8, j, b]
    plane = torch.zeros(nb, kc, 8, 4, dtype=torch.uint8)
    for half in range(2):
        for j in range(4):
            plane.bitwise_or_(high[:, :, half, :, j, :] << (4 * half + j))
    return plane.reshape(nb, kc, 32)


def _high_plane(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[NB, 16, KC, 8] stream codes -> the high-bit plane uint8 [NB, KC, 16 * (bits - 4)] (csrc/common.h):
    lane r's high bits of position 4n + b in byte 4 * (r % R) + b at bit HB * (2 * (r / R) + n), R = 4 * HB.
    3-bit codes: :func:`_third_plane`."""
    if bits == 3:
        return _third_plane(q)
    hb = bits - 4
    rows = 4 * hb
    nb, _, kc, _ = q.shape
    high = (q >> 4).permute(0, 2, 1, 3).reshape(nb, kc, LANES // rows, rows, 2, 4)  # uint8, one copy
    plane = torch.zeros(nb, kc, rows, 4, dtype=torch.uint8)
    for slot in range(LANES // rows):  # 2 (6-bit) or 4 (5-bit) lane groups x 2 nibbles: bytewise ORs
        for n in range(2):
            plane.bitwise_or_(high[:, :, slot, :, n, :] << (hb * (2 * slot + n)))
    return plane.reshape(nb, kc, 4 * rows)


def _kernel_two_level(w: QuantizedWeight, order: StreamOrder) -> bool:
    """Whether the kernel can hold ``w``'s two-level scales as they are (else they are flattened, exactly)."""
    if w.super_scales is None or w.scales.dtype != torch.int8:
        return False
    if w.offsets is not None and (w.super_offsets is None or w.offsets.dtype != torch.int8
                                  or w.super_offsets.dtype != w.super_scales.dtype):
        return False
    return torch.equal(order.seg_group, torch.arange(w.num_groups))  # every segment one group


def _levels(w: QuantizedWeight, order: StreamOrder) -> tuple:
    """(scales, offsets, super_scales, super_offsets): [N, G] and [N, S'] as the kernel holds them.

    One level: float scales and offsets of one dtype (float32 when they differ).  Two levels:
    the int8 sub-values and the float super-block values.
    """
    if w.two_level and _kernel_two_level(w, order):
        return w.scales, w.offsets, w.super_scales, w.super_offsets
    w = w.single_level()
    scales, offsets = w.scales, w.offsets
    if offsets is not None and offsets.dtype != scales.dtype:  # one dtype for both (exact in float32)
        scales, offsets = scales.float(), offsets.float()
    return scales, offsets, None, None


def _sub_packing(bits: int, subs: list[torch.Tensor]) -> tuple[int, int]:
    """(sub_bits, sub_bias) for two-level sub-values ``subs`` (int8): 2/3-bit codes pack them in 4 or
    6 bits when every value fits (Q2_K's 0..15, Q3_K's -32..31), so they cost the file's bits."""
    if bits > 3:
        return 8, 0
    lo, hi = min(int(t.min()) for t in subs), max(int(t.max()) for t in subs)
    for sub_bits, bias in ((4, 0), (6, 0), (6, 32)):
        if lo + bias >= 0 and hi + bias < (1 << sub_bits):
            return sub_bits, bias
    return 8, 0


def _pack_subs(v: torch.Tensor, sub_bits: int, bias: int) -> torch.Tensor:
    """int8 [NB, S, 16] sub-values -> uint8 [NB, SR, 16] of ``sub_bits``-bit u = v + bias (csrc/common.h)."""
    nb, nseg, _ = v.shape
    per = 2 if sub_bits == 4 else 4
    u = (v.to(torch.int16) + bias).to(torch.uint8)
    if nseg % per:
        u = torch.cat([u, u.new_zeros(nb, per - nseg % per, LANES)], dim=1)
    u = u.view(nb, -1, per, LANES)
    if sub_bits == 4:
        return (u[:, :, 0] | (u[:, :, 1] << 4)).contiguous()
    lo, hi = u & 15, u >> 4
    rows = (lo[:, :, 0] | (lo[:, :, 1] << 4), lo[:, :, 2] | (lo[:, :, 3] << 4),
            hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6))
    return torch.stack(rows, dim=2).view(nb, -1, LANES)


def _row_sums(w: QuantizedWeight, rows: int = 1024) -> torch.Tensor:
    """float32 [N]: sums of the dequantized rows, computed in float64 a slice of rows at a time."""
    return torch.cat([
        w.take_rows(torch.arange(r0, min(r0 + rows, w.out_features))).dequantize().double().sum(1)
        for r0 in range(0, w.out_features, rows)]).float()


def _zeros(w: QuantizedWeight, order: StreamOrder, nb: int) -> tuple[torch.Tensor | None, int | None]:
    """(zeros [NB, S, 16] or None, the constant zero point when every group has the same one)."""
    if w.zeros is None:
        return None, None
    lo, hi = int(w.zeros.min()), int(w.zeros.max())
    limit = 32767 if w.bits == 8 else 255
    if lo < 0 or hi > limit:
        raise KernelError(f"{w.name}: zero points span [{lo}, {hi}], expected [0, {1 << w.bits}]")
    if lo == hi:  # GGUF Q4_1 / K-quants: all 0, offsets carry the minimum
        return None, lo
    return _per_segment(w.zeros.to(torch.int16 if w.bits == 8 else torch.uint8), order, nb), None


def pack(w: QuantizedWeight, int8_activations: bool) -> PackedWeight:
    """Repack ``w`` (2- to 6- or 8-bit) for the native kernels; ``int8_activations`` selects the int8 limits."""
    if w.bits not in INT8_MAX_SEGMENT:
        raise KernelError(f"{w.name}: native kernels run 2-, 3-, 4-, 5-, 6- and 8-bit codes, found {w.bits}-bit")
    if w.out_features == 0 or w.in_features == 0:
        raise KernelError(f"{w.name}: empty weight [{w.out_features}, {w.in_features}]")
    order = stream_order(w, INT8_MAX_SEGMENT[w.bits] if int8_activations else FLOAT_MAX_SEGMENT)
    nb = -(-w.out_features // LANES)
    scales, offsets, super_scales, super_offsets = _levels(w, order)
    zeros, zconst = _zeros(w, order, nb)
    wsum = None
    if w.activation is not None and not w.activation.symmetric:
        rows = _row_sums(w)
        wsum = torch.cat([rows, rows.new_zeros(nb * LANES - w.out_features)])
    # what the kernels stream goes on 2 MiB pages (quill/native/csrc/hugepage.cpp), gathered
    # straight from the strided views
    ext = native.load().module
    place = ext.huge_page_copy if ext is not None else (lambda t: t.contiguous())
    q = _stream_codes(w, order, nb)  # [NB, 16, KC, CK]
    codes = place(_codes(q, w.bits)).view(nb, -1, BLOCK_BYTES)  # [NB, KC, 64]
    hplane = place(_high_plane(q, w.bits)) if plane_bytes(w.bits) else None
    del q

    sub_bits, sub_bias = 8, 0
    if super_scales is not None:
        sub_bits, sub_bias = _sub_packing(w.bits, [t for t in (scales, offsets if super_offsets is not None else None)
                                                   if t is not None])

    def segs(t, packed=False):
        if t is None:
            return None
        v = _per_segment(t, order, nb)
        return place(_pack_subs(v, sub_bits, sub_bias) if packed and sub_bits != 8 else v)

    def supers(t):
        return None if t is None else place(_per_lane(t, nb))  # [N, S'] -> [NB, S', 16]
    return PackedWeight(
        codes=codes, scales=segs(scales, super_scales is not None), zeros=None if zeros is None else place(zeros),
        offsets=segs(offsets, super_offsets is not None),
        seg_end=order.seg_end, src=order.src, wsum=wsum, bits=w.bits,
        out_features=w.out_features, in_features=w.in_features, hplane=hplane,
        super_scales=supers(super_scales), super_offsets=supers(super_offsets), zconst=zconst,
        sub_bits=sub_bits, sub_bias=sub_bias,
    )


def pack_dense(w: torch.Tensor) -> torch.Tensor:
    """bfloat16/float16 [N, K] -> int16 [NB, KP, 16, 2] (csrc/dense.h): row blocks of 16, column pairs.

    The words are the weight's own bits (no conversion); N is padded with zero rows and
    K with a zero column to even.  Gathered straight onto 2 MiB pages.
    """
    if w.dtype not in (torch.bfloat16, torch.float16) or w.dim() != 2:
        raise KernelError(f"native dense: weight should be a 2-D bfloat16/float16 tensor, found {w.dtype} "
                          f"{list(w.shape)}")
    n, k = w.shape
    nb, kp = -(-n // LANES), -(-k // 2)
    bits = w.view(torch.int16)
    if nb * LANES != n or 2 * kp != k:
        bits = torch.nn.functional.pad(bits, (0, 2 * kp - k, 0, nb * LANES - n))
    ext = native.load().module
    place = ext.huge_page_copy if ext is not None else (lambda t: t.contiguous())
    return place(bits.view(nb, LANES, kp, 2).permute(0, 2, 1, 3))  # [NB, KP, 16, 2]
