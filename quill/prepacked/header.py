"""A prepacked cache file's header: read and checked without torch (``quill cache list`` reads only these).

The file itself (quill.prepacked.file) is safetensors: an 8-byte length, this JSON header, the data.
``header_checksum``, the header's first entry (so at a fixed offset), is the XXH3-128 of the length
prefix and the header with that value written as zeros.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

from quill.errors import CacheError

_MAX_HEADER = 256 << 20
HEADER_SUM = "header_checksum"
START = f'{{"__metadata__":{{"{HEADER_SUM}":"'.encode()  # how every checked header begins
SUM_AT = len(START)  # where the checksum's 32 hex digits start in the header JSON
SUM_LEN = 32
UNSET = b"0" * SUM_LEN
# Bytes per element of each safetensors dtype a cache file may hold (quill.formats.safetensors_io.DTYPES).
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1}


def header_digest(head: bytes) -> bytes:
    """XXH3-128 (hex) of the length prefix and header ``head``, its checksum's digits counted as zeros."""
    h = xxhash.xxh3_128(head[:8 + SUM_AT])
    h.update(UNSET)
    h.update(head[8 + SUM_AT + SUM_LEN:])
    return h.hexdigest().encode()


@dataclass
class Header:
    """A cache file's header: quill's facts, the other metadata, and where each tensor lies."""

    facts: dict
    metadata: dict[str, str]
    entries: dict[str, tuple[str, tuple[int, ...], int, int]]  # name -> (safetensors dtype, shape, begin, end)
    data_start: int
    data_len: int


def read_header(path: Path, verify: bool = True) -> Header:
    """Parse and check ``path``'s header against its checksum and size (a CacheError names what is wrong).

    ``verify=False`` skips the checksum and accepts older files without one: only to decide which files a
    new one supersedes, never to load one."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CacheError(f"{path}: truncated ({size} bytes)")
        (n,) = struct.unpack("<Q", prefix)
        if n > _MAX_HEADER or 8 + n > size:
            raise CacheError(f"{path}: truncated or corrupt: header of {n} bytes, file of {size}")
        raw = f.read(n)
        if verify:
            check_header(path, prefix + raw)
        try:
            header = json.loads(raw)
            metadata = header.pop("__metadata__")
            facts = json.loads(metadata["quill"])
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise CacheError(f"{path}: header is not a prepacked cache header ({type(e).__name__}: {e})") from None
    entries, end_max = {}, 0
    for name, e in header.items():
        try:
            dtype, shape, (b, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
            itemsize = DTYPE_SIZES[dtype]
        except (KeyError, TypeError, ValueError):
            raise CacheError(f"{path}: tensor '{name}' has a malformed entry {e}") from None
        if end - b != math.prod(shape) * itemsize or b < 0:
            raise CacheError(f"{path}: tensor '{name}': offsets [{b}, {end}] do not fit {e['dtype']} {list(shape)}")
        entries[name] = (dtype, shape, b, end)
        end_max = max(end_max, end)
    if 8 + n + end_max != size:
        raise CacheError(f"{path}: truncated or corrupt: data ends at byte {8 + n + end_max}, file has {size}")
    return Header(facts, metadata, entries, 8 + n, end_max)


def check_header(path: Path, head: bytes) -> None:
    """A CacheError unless ``head`` (length prefix and header) carries its checksum and matches it."""
    stored = head[8 + SUM_AT:8 + SUM_AT + SUM_LEN]
    if head[8:8 + SUM_AT] != START or len(stored) != SUM_LEN or head[8 + SUM_AT + SUM_LEN:][:1] != b'"':
        raise CacheError(f"{path}: corrupt, or not written by this quill: the header does not begin with its "
                         f"'{HEADER_SUM}'")
    if header_digest(head) != stored:
        raise CacheError(f"{path}: corrupt: the header's checksum differs from the one written "
                         f"({stored.decode(errors='replace')})")
