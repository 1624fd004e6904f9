"""Bit-packing of integer codes into int32 words: the one place that shifts bits.

Every format stores b-bit codes as a little-endian bitstream inside int32 words
along one dimension: value j of a packed row occupies bits [j*b, (j+1)*b) of the
stream, word w holding bits [32*w, 32*w + 32).  For b in {2, 4, 8} that is
simply ``32 // b`` values per word, lowest bits first; for b = 3 (GPTQ) values
straddle words, which the same bitstream rule covers.

Some formats also permute the values inside each word (AWQ: slot i holds logical
column ``order[i]``); ``order`` describes that permutation.

``straddle=False`` selects the other layout some writers use for widths that do
not divide 32: ``32 // b`` whole values per word, lowest bits first, the top
``32 % b`` bits unused (compressed-tensors <= 0.17 stored 3-bit values this way,
10 per word).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from quill.errors import CheckpointError


def _check_packed(packed: torch.Tensor, what: str) -> None:
    if packed.dtype != torch.int32:
        raise CheckpointError(f"{what}: packed tensor should be int32, found {packed.dtype}")


def _apply_order_inverse(vals: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """vals[..., words, slots] in storage order -> logical order (slot i is column order[i])."""
    inv = torch.empty(len(order), dtype=torch.long)
    inv[torch.tensor(list(order), dtype=torch.long)] = torch.arange(len(order))
    return vals[..., inv]


def unpack_int32(
    packed: torch.Tensor,
    bits: int,
    dim: int,
    count: int | None = None,
    order: Sequence[int] | None = None,
    what: str = "tensor",
    straddle: bool = True,
) -> torch.Tensor:
    """Unpack b-bit unsigned fields from int32 words along ``dim``; returns uint8 (int16 for b > 8 never occurs).

    Args:
        packed: int32 tensor with the packed dimension ``dim``.
        bits: field width (2, 3, 4 or 8).
        dim: the packed dimension.
        count: number of logical values along ``dim`` (default: all that fit).
        order: in-word slot permutation (AWQ), only for b dividing 32.
        what: name used in error messages.
        straddle: for b not dividing 32, whether values straddle words (bitstream,
            the default) or each word holds ``32 // b`` values and wastes the rest.
    """
    _check_packed(packed, what)
    x = packed.movedim(dim, -1).contiguous()
    words = x.shape[-1]
    whole_words = 32 % bits == 0 or not straddle
    capacity = words * (32 // bits) if whole_words else words * 32 // bits
    count = capacity if count is None else count
    if count > capacity or count < 0:
        raise CheckpointError(
            f"{what}: {words} int32 words along dim {dim} hold {capacity} {bits}-bit values, "
            f"but {count} are needed")
    if whole_words:
        per = 32 // bits
        shifts = torch.arange(per, dtype=torch.int32) * bits
        vals = (x.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per]
        if order is not None:
            vals = _apply_order_inverse(vals, order)
        vals = vals.reshape(*x.shape[:-1], words * per)
    else:
        if order is not None:
            raise CheckpointError(f"{what}: an in-word order is meaningless for {bits}-bit straddling fields")
        vals = _unpack_bitstream(x, bits, capacity)
    return vals[..., :count].to(torch.uint8).movedim(-1, dim).contiguous()


def _unpack_bitstream(x: torch.Tensor, bits: int, capacity: int) -> torch.Tensor:
    """Generic little-endian bitstream unpack (for widths that straddle words)."""
    arr = x.numpy().astype("<i4", copy=False).view(np.uint8)  # [..., words*4] little-endian bytes
    bitarr = np.unpackbits(arr, axis=-1, bitorder="little")[..., : capacity * bits]
    bitarr = bitarr.reshape(*x.shape[:-1], capacity, bits).astype(np.int32)
    weights = (1 << np.arange(bits, dtype=np.int32))
    return torch.from_numpy((bitarr * weights).sum(-1).astype(np.int32))


def pack_int32(
    values: torch.Tensor,
    bits: int,
    dim: int,
    order: Sequence[int] | None = None,
    straddle: bool = True,
) -> torch.Tensor:
    """Inverse of :func:`unpack_int32`: pack unsigned b-bit values along ``dim`` into int32 words.

    The length along ``dim`` is zero-padded up to a whole number of words.
    """
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= (1 << bits)):
        raise ValueError(f"values must lie in [0, {1 << bits}) to pack into {bits} bits")
    x = values.movedim(dim, -1).to(torch.int64).contiguous()
    n = x.shape[-1]
    if 32 % bits == 0 or not straddle:
        per = 32 // bits
        words = -(-n // per)
        x = torch.nn.functional.pad(x, (0, words * per - n)).reshape(*x.shape[:-1], words, per)
        if order is not None:
            x = x[..., torch.tensor(list(order), dtype=torch.long)]
        shifts = torch.arange(per, dtype=torch.int64) * bits
        acc = (x << shifts).sum(-1)
    else:
        if order is not None:
            raise ValueError(f"an in-word order is meaningless for {bits}-bit straddling fields")
        words = -(-n * bits // 32)
        arr = x.numpy().astype(np.int64)
        bitarr = ((arr[..., None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(*arr.shape[:-1], n * bits)
        bitarr = np.concatenate(
            [bitarr, np.zeros((*arr.shape[:-1], words * 32 - n * bits), dtype=np.uint8)], axis=-1)
        packed_bytes = np.packbits(bitarr, axis=-1, bitorder="little")
        acc = torch.from_numpy(packed_bytes.view("<i4").astype(np.int64))
    # two's complement into int32 (values above 2**31 wrap to negative)
    acc = torch.where(acc >= (1 << 31), acc - (1 << 32), acc)
    return acc.to(torch.int32).movedim(-1, dim).contiguous()
