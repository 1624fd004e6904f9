"""GGUF (ggml) block formats -> the canonical :class:`QuantizedWeight`.

Block layouts (ggml-common.h; 32 weights per block, one row of ``ne[0]`` weights
is ``ne[0] / 32`` consecutive blocks)::

    Q4_0  { f16 d;           u8 qs[16]; }   w = (q - 8) * d
    Q4_1  { f16 d; f16 m;    u8 qs[16]; }   w = q * d + m
    Q8_0  { f16 d;           i8 qs[32]; }   w = qs * d
    MXFP4 { u8 e;            u8 qs[16]; }   w = kvalues_mxfp4[q] * 2**(e - 128)

In Q4_0/Q4_1 the low nibble of ``qs[j]`` is weight ``j`` and the high nibble is
weight ``j + 16`` (not ``2j``/``2j + 1``).  The canonical forms, exact because
every step is the same float32 operation ggml/gguf-py perform:

* Q4_0: codes = q, symmetric (implicit zero 8), scales = d.
* Q4_1: codes = q, zeros = 0, offsets = m, scales = d.
* Q8_0: codes = qs + 128 (the int8 bit pattern XOR 0x80), symmetric, scales = d.
* MXFP4: codes = q (FP4 E2M1 codes), codebook = the E2M1 values, scales = e as E8M0
  (2**(e - 127)).  ggml's table is the E2M1 values doubled and its scale (e8m0_to_fp32_half)
  halved: both products are a small power-of-two multiple, the same float32.

Q5_0 / Q5_1 and the K-quants (Q2_K ... Q6_K) are in :mod:`quill.formats.gguf.kquants`.
"""

from __future__ import annotations

import torch

from quill.canonical import E8M0, FP4_E2M1, QuantizedWeight
from quill.errors import UnsupportedFormatError
from quill.formats.gguf.blocks import flat, half_field, nibbles
from quill.formats.gguf.file import GGML_TYPE_IDS, GGML_TYPES
from quill.formats.gguf.kquants import CONVERTERS

GROUP = 32
Q4_0, Q4_1, Q8_0 = GGML_TYPE_IDS["Q4_0"], GGML_TYPE_IDS["Q4_1"], GGML_TYPE_IDS["Q8_0"]
MXFP4 = GGML_TYPE_IDS["MXFP4"]
F32, F16, BF16 = GGML_TYPE_IDS["F32"], GGML_TYPE_IDS["F16"], GGML_TYPE_IDS["BF16"]

QUANTIZED_TYPES = (Q4_0, Q4_1, Q8_0, *(GGML_TYPE_IDS[n] for n in CONVERTERS), MXFP4)
DENSE_TYPES: dict[int, torch.dtype] = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
SUPPORTED_TYPE_NAMES = tuple(GGML_TYPES[t][0] for t in (*QUANTIZED_TYPES, *DENSE_TYPES))


def check_supported(ggml_type: int, tensor: str) -> None:
    """Raise ``UnsupportedFormatError`` naming the tensor unless quill reads its ggml type."""
    if ggml_type not in QUANTIZED_TYPES and ggml_type not in DENSE_TYPES:
        raise UnsupportedFormatError(
            f"tensor '{tensor}' has ggml type {GGML_TYPES[ggml_type][0]}, which quill does not read; "
            f"supported: {', '.join(SUPPORTED_TYPE_NAMES)}")


def block_weight(raw: torch.Tensor, ggml_type: int, name: str) -> QuantizedWeight:
    """Convert one matrix of blocks, uint8 ``[out, row_bytes]``, into a canonical ``[out, in]`` weight."""
    _, block, type_size = GGML_TYPES[ggml_type]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, type_size)  # [out, in / 32, type_size]
    if ggml_type == Q4_0:
        d = half_field(blocks, 0)
        return QuantizedWeight(codes=flat(nibbles(blocks[..., 2:])), bits=4, group_size=GROUP, scales=d,
                               dtype=torch.float32, name=name)
    if ggml_type == Q4_1:
        d, m = half_field(blocks, 0), half_field(blocks, 2)
        return QuantizedWeight(codes=flat(nibbles(blocks[..., 4:])), bits=4, group_size=GROUP, scales=d,
                               zeros=torch.zeros(d.shape, dtype=torch.int16), offsets=m,
                               dtype=torch.float32, name=name)
    if ggml_type == Q8_0:
        d = half_field(blocks, 0)
        codes = (blocks[..., 2:] ^ 0x80).reshape(rows, -1)  # int8 q -> q + 128 as uint8
        return QuantizedWeight(codes=codes, bits=8, group_size=GROUP, scales=d, dtype=torch.float32, name=name)
    if ggml_type == MXFP4:
        scales = blocks[..., 0].contiguous().view(E8M0)  # [out, in / 32]
        return QuantizedWeight(codes=flat(nibbles(blocks[..., 1:])), bits=4, group_size=GROUP, scales=scales,
                               codebook=FP4_E2M1.clone(), dtype=torch.float32, name=name)
    if GGML_TYPES[ggml_type][0] in CONVERTERS:
        return CONVERTERS[GGML_TYPES[ggml_type][0]](blocks, name)
    raise UnsupportedFormatError(
        f"tensor '{name}' has ggml type {GGML_TYPES[ggml_type][0]}, which has no canonical quantized form; "
        f"supported: {', '.join(GGML_TYPES[t][0] for t in QUANTIZED_TYPES)}")

