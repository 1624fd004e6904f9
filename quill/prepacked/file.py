"""One prepacked cache file: safetensors with checksums, written whole and renamed, read whole into place.

A plain safetensors file (any safetensors reader opens it) whose ``__metadata__`` holds
quill's facts (``quill``: JSON) and the tokenizer (``tokenizer``: its JSON).  Every byte a
load uses is checked: the ``quill`` facts carry an XXH3-128 checksum of the data section, and
``header_checksum``, the header's first entry (so at a fixed offset), is the XXH3-128 of the
length prefix and the header with that value written as zeros: a flipped digit of a stored
``rope_theta`` is caught before anything reads it.  Tensors are laid out
largest alignment first (the power of two dividing their size, up to 64), after a header
padded to 64 bytes, so every kernel array starts on a cache line and the data section
is memory-mapped whole: the tensors are views of the page cache's pages, not copies.  A file that is truncated,
whose header does not parse, or whose header or data checksum differs raises :class:`CacheError`.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from quill.errors import CacheError
from quill.formats.safetensors_io import DTYPES
from quill.prepacked.header import HEADER_SUM, SUM_AT, SUM_LEN, UNSET, Header, header_digest
from quill.prepacked.leftovers import temp_path

ALIGN = 64
_CHUNK = 64 << 20  # bytes per read/write call
_MADV_HUGEPAGE = 14  # linux/mman.h (the mmap module does not name it everywhere)
DTYPE_NAMES: dict[torch.dtype, str] = {d: n for n, d in DTYPES.items()}  # safetensors' names, the readers' table


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous ``t`` (kept alive by the caller), without a copy."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


def _alignment(nbytes: int) -> int:
    return ALIGN if nbytes == 0 else min(ALIGN, nbytes & -nbytes)


def _order(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The tensors in file order, contiguous: largest alignment first, so every offset is a multiple of
    the alignment of what follows."""
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise CacheError(f"tensor '{name}': dtype {t.dtype} cannot be saved; supported: "
                             f"{', '.join(DTYPE_NAMES.values())}")
    return sorted(((n, t.contiguous()) for n, t in tensors.items()),
                  key=lambda item: (-_alignment(item[1].numel() * item[1].element_size()), item[0]))


def _header(order: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    """The length prefix and header JSON, padded so the data section starts on a multiple of ALIGN, with its
    checksum filled in."""
    if HEADER_SUM in metadata:
        raise CacheError(f"metadata key '{HEADER_SUM}' is the file's own; pick another name")
    entries, offset = {}, 0
    for name, t in order:
        n = t.numel() * t.element_size()
        entries[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps({"__metadata__": {HEADER_SUM: UNSET.decode(), **metadata}, **entries},
                      separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)  # safetensors allows trailing spaces in the header
    head = struct.pack("<Q", len(text)) + text
    digest = header_digest(head)
    return head[:8 + SUM_AT] + digest + head[8 + SUM_AT + SUM_LEN:]


def write_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], facts: dict) -> int:
    """Write ``tensors`` to ``path`` (via a temporary name in the same directory, then an atomic rename).

    ``facts`` go under ``__metadata__['quill']`` with the data's checksum added, and the header's checksum
    beside them; returns the file size.
    Tensors must stay unchanged while this runs (it may run on a background thread).
    """
    order = _order(tensors)
    h = xxhash.xxh3_128()
    for _, t in order:
        h.update(_bytes(t))
    head = _header(order, {**metadata, "quill": json.dumps({**facts, "checksum": h.hexdigest()},
                                                           separators=(",", ":"))})
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            for _, t in order:
                view = _bytes(t)
                for start in range(0, len(view), _CHUNK):
                    f.write(view[start:start + _CHUNK])
        size = tmp.stat().st_size
        os.replace(tmp, path)  # readers see no file or a whole one, never a torn one
        return size
    finally:
        tmp.unlink(missing_ok=True)


@dataclass
class MappedData:
    """A cache file's tensors, views of one private memory map of it."""

    tensors: dict[str, torch.Tensor]
    mapping: mmap.mmap | None
    base: int = 0  # the mapping's address

    def drop_pages(self, t: torch.Tensor) -> None:
        """Unmap the whole pages under ``t`` from this process (the page cache keeps them, a read maps them
        again): for tables read a few rows at a time, so only rows in use stay resident.  Tensors outside
        this mapping are left alone."""
        if self.mapping is None:
            return
        a = t.data_ptr() - self.base
        b = a + t.numel() * t.element_size()
        if a < 0 or b > len(self.mapping):
            return
        a, b = -(-a // mmap.PAGESIZE) * mmap.PAGESIZE, b // mmap.PAGESIZE * mmap.PAGESIZE
        if b > a:
            self.mapping.madvise(mmap.MADV_DONTNEED, a, b - a)  # unwritten private pages: the file's again


def map_data(path: Path, header: Header) -> MappedData:
    """Every tensor of ``path`` as a view of one private memory map, after checking the data's checksum.

    The kernels read the page cache's own pages (no copy; written ones would be copied, never
    the file).  Mapping and hashing release the GIL: callers may run this on a thread.
    """
    if header.data_len == 0:
        return MappedData({name: torch.empty(shape, dtype=DTYPES[dtype])
                           for name, (dtype, shape, _, _) in header.entries.items()}, None)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:  # best effort: 2 MiB mappings where the page cache holds large folios
        mm.madvise(_MADV_HUGEPAGE)
    except OSError:
        pass
    view = memoryview(mm)[header.data_start:header.data_start + header.data_len]
    try:
        if xxhash.xxh3_128(view).hexdigest() != header.facts.get("checksum"):
            raise CacheError(f"{path}: corrupt: the data's checksum differs from the one written "
                             f"({header.data_len} bytes from byte {header.data_start})")
    finally:
        view.release()
    buf = torch.frombuffer(mm, dtype=torch.uint8, offset=header.data_start, count=header.data_len)
    tensors = {name: buf[b:e].view(DTYPES[dtype]).view(shape)
               for name, (dtype, shape, b, e) in header.entries.items()}
    return MappedData(tensors, mm, buf.data_ptr() - header.data_start)
