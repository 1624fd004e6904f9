"""The GGUF container: header, metadata, tensor table, and memory-mapped tensor data.

Layout (little-endian, versions 2 and 3; llama.cpp's ``gguf.cpp`` and ``docs/gguf.md``)::

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count   x  { string key | u32 value_type | value }
    tensor_count x { string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset }
    padding to ``general.alignment`` (default 32)
    tensor data; each tensor at data_offset + offset (offset a multiple of the alignment)

    string = u64 length + UTF-8 bytes;  array = u32 element type + u64 count + elements

``ne[0]`` is the innermost, contiguous dimension: a linear weight's ``ne`` is
``[in_features, out_features]``, i.e. row-major ``[out, in]``.  Quantized types
store ``ne[0] / block_size`` blocks of ``type_size`` bytes per row.

Nothing is executed or unpickled: the header is parsed with ``struct`` and every
length and offset is checked against the file size before it is used, so a
truncated or corrupt file raises :class:`CheckpointError` naming what is wrong.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quill.errors import CheckpointError, UnsupportedFormatError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ARRAY_DEPTH = 8


# ---- value types ------------------------------------------------------------

class ValueType:
    """GGUF metadata value type ids (``enum gguf_type``)."""

    UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)


# scalar value type -> (struct format, numpy dtype, name)
_SCALARS: dict[int, tuple[str, str, str]] = {
    ValueType.UINT8: ("<B", "<u1", "uint8"),
    ValueType.INT8: ("<b", "<i1", "int8"),
    ValueType.UINT16: ("<H", "<u2", "uint16"),
    ValueType.INT16: ("<h", "<i2", "int16"),
    ValueType.UINT32: ("<I", "<u4", "uint32"),
    ValueType.INT32: ("<i", "<i4", "int32"),
    ValueType.FLOAT32: ("<f", "<f4", "float32"),
    ValueType.BOOL: ("<B", "<u1", "bool"),
    ValueType.UINT64: ("<Q", "<u8", "uint64"),
    ValueType.INT64: ("<q", "<i8", "int64"),
    ValueType.FLOAT64: ("<d", "<f8", "float64"),
}
VALUE_TYPE_NAMES = {**{k: v[2] for k, v in _SCALARS.items()}, ValueType.STRING: "string", ValueType.ARRAY: "array"}


# ---- tensor types -------------------------------------------------------------

# ggml type id -> (name, elements per block, bytes per block), from ggml.h / ggml.c type_traits.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}
GGML_TYPE_IDS = {name: tid for tid, (name, _, _) in GGML_TYPES.items()}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table; ``shape`` is ggml's ``ne`` (innermost first)."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type][0]

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """Row-major shape, outermost first (``ne`` reversed): ``[out, in]`` for a linear weight."""
        return tuple(reversed(self.shape))

    @property
    def block_size(self) -> int:
        return GGML_TYPES[self.ggml_type][1]

    @property
    def type_size(self) -> int:
        return GGML_TYPES[self.ggml_type][2]

    @property
    def row_bytes(self) -> int:
        """Bytes of one ``ne[0]`` row."""
        return self.shape[0] // self.block_size * self.type_size if self.shape else self.type_size


# ---- the header reader ----------------------------------------------------------

class _Cursor:
    """Bounds-checked sequential reads from the mapped file."""

    def __init__(self, buf, size: int, path: Path):
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: truncated or corrupt GGUF file: {what}")

    def take(self, n: int, what: str) -> int:
        """Reserve ``n`` bytes at the cursor; return their start."""
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos}, the file has {self.size}")
        start = self.pos
        self.pos += n
        return start

    def scalar(self, fmt: str, what: str):
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.buf, start)[0]

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        start = self.take(n, what)
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} at offset {start} is not valid UTF-8 ({e.reason})") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            v = self.scalar(_SCALARS[vtype][0], what)
            return bool(v) if vtype == ValueType.BOOL else v
        if vtype == ValueType.STRING:
            return self.string(what)
        if vtype == ValueType.ARRAY:
            return self.array(what, depth)
        raise self.fail(f"{what} has value type {vtype}; known types are 0..12")

    def array(self, what: str, depth: int) -> list:
        return self.typed_array(what, depth)[1]

    def typed_array(self, what: str, depth: int) -> tuple[int, list]:
        """(element type, values) of an array value."""
        if depth >= _MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays deeper than {_MAX_ARRAY_DEPTH}")
        etype = self.u32(f"element type of {what}")
        count = self.u64(f"length of {what}")
        if etype in _SCALARS:
            fmt, dtype, _ = _SCALARS[etype]
            start = self.take(count * struct.calcsize(fmt), f"{count} elements of {what}")
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).tolist()
            return etype, [bool(v) for v in values] if etype == ValueType.BOOL else values
        if etype not in (ValueType.STRING, ValueType.ARRAY):
            raise self.fail(f"{what} has element type {etype}; known types are 0..12")
        # Every element takes at least 8 bytes (a length or a count): reject absurd counts before looping.
        if count * 8 > self.size - self.pos:
            raise self.fail(f"{what} claims {count} elements, more than the {self.size - self.pos} bytes left")
        if etype == ValueType.STRING:
            return etype, self.strings(count, what)
        return etype, [self.value(etype, f"{what}[{i}]", depth + 1) for i in range(count)]

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings in a row (a vocabulary: ~100k of them), in one tight loop."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        unpack = _U64.unpack_from
        for i in range(count):
            if pos + 8 > size:
                raise self.fail(f"length of {what}[{i}] needs 8 bytes at offset {pos}, the file has {size}")
            n = unpack(buf, pos)[0]
            pos += 8
            if pos + n > size:
                raise self.fail(f"{what}[{i}] needs {n} bytes at offset {pos}, the file has {size}")
            try:
                out.append(str(buf[pos:pos + n], "utf-8"))
            except UnicodeDecodeError as e:
                raise self.fail(f"{what}[{i}] at offset {pos} is not valid UTF-8 ({e.reason})") from None
            pos += n
        self.pos = pos
        return out


_U64 = struct.Struct("<Q")


def _copied_kb(m: mmap.mmap) -> int | None:
    """Kilobytes of ``m`` written through the mapping (private copies: "Anonymous" in /proc/self/smaps);
    None if unknown."""
    start = ctypes.addressof(ctypes.c_char.from_buffer(m))
    head = f"{start:x}-"
    try:
        with open("/proc/self/smaps") as f:
            found = False
            for line in f:
                if not found:
                    found = line.startswith(head)
                elif line.startswith("Anonymous:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class GGUFFile:
    """A parsed GGUF file. Tensor data stays in a private memory map until asked for.

    Attributes:
        path, version, alignment, data_offset (absolute start of the tensor data).
        metadata: key -> Python value (int, float, bool, str, or list for arrays).
        value_types: key -> the stored type, e.g. ``"uint32"`` or ``("array", "string")``.
        tensors: name -> :class:`GGUFTensorInfo`, in file order.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self.size = self.path.stat().st_size
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open GGUF file ({e.strerror})") from None
        if self.size < 24:
            raise CheckpointError(f"{self.path}: truncated GGUF file ({self.size} bytes, the header alone needs 24)")
        with open(self.path, "rb") as f:
            # ACCESS_COPY: writable (torch.frombuffer wants that) but never written back.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        cur = _Cursor(self._map, self.size, self.path)
        self.version, n_tensors, n_kv = self._read_preamble(cur)
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, Any] = {}
        self._read_metadata(cur, n_kv)
        self.alignment = self._alignment()
        infos = [self._read_tensor_info(cur, i) for i in range(n_tensors)]
        self.data_offset = _align(cur.pos, self.alignment)
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for info in infos:
            self._add_tensor(*info)

    def release_pages(self) -> None:
        """Hand the file's resident pages back once loading has read them: they count as the process's
        memory while mapped, but after repacking only a few (embedding rows) are read again, and those
        fault back in.  A mapping nothing wrote to drops its pages (MADV_DONTNEED: they stay in the
        page cache, so the next load is still warm); one with written (private, copied) pages is only
        paged out (MADV_PAGEOUT), which never discards data.  Linux only; elsewhere a no-op."""
        if sys.platform != "linux":
            return
        copied = _copied_kb(self._map)
        # Python 3.11's mmap module lacks MADV_PAGEOUT; Linux has had it (21) since 5.4
        advice = mmap.MADV_DONTNEED if copied == 0 else getattr(mmap, "MADV_PAGEOUT", 21)
        try:
            self._map.madvise(advice)
        except OSError:  # an older kernel: nothing released, nothing wrong
            pass

    # ---- header ------------------------------------------------------------
    def _read_preamble(self, cur: _Cursor) -> tuple[int, int, int]:
        magic = bytes(self._map[0:4])
        cur.take(4, "magic")
        if magic != GGUF_MAGIC:
            raise CheckpointError(f"{self.path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        version = cur.u32("version")
        if version not in SUPPORTED_VERSIONS:
            swapped = struct.unpack("<I", struct.pack(">I", version))[0]
            hint = " (a big-endian file: quill reads little-endian GGUF only)" if swapped in (1, 2, 3) else ""
            raise UnsupportedFormatError(
                f"{self.path}: GGUF version {version} is not supported{hint}; supported: "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        # Each kv or tensor entry takes well over 8 bytes; larger counts cannot fit in the file.
        if (n_tensors + n_kv) * 8 > self.size:
            raise cur.fail(f"header claims {n_tensors} tensors and {n_kv} metadata entries, "
                           f"more than a {self.size}-byte file can hold")
        return version, n_tensors, n_kv

    def _read_metadata(self, cur: _Cursor, n_kv: int) -> None:
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.u32(f"value type of '{key}'")
            if key in self.metadata:
                raise cur.fail(f"metadata key '{key}' appears twice")
            if vtype == ValueType.ARRAY:
                etype, value = cur.typed_array(f"metadata '{key}'", 0)
                self.value_types[key] = ("array", VALUE_TYPE_NAMES[etype])
            else:
                value = cur.value(vtype, f"metadata '{key}'")
                self.value_types[key] = VALUE_TYPE_NAMES[vtype]
            self.metadata[key] = value

    def _alignment(self) -> int:
        if "general.alignment" not in self.metadata:
            return DEFAULT_ALIGNMENT
        a = self.metadata["general.alignment"]
        if self.value_types["general.alignment"] != "uint32" or a <= 0 or a & (a - 1):
            raise CheckpointError(f"{self.path}: general.alignment should be a power-of-two uint32, found "
                                  f"{a!r} ({self.value_types['general.alignment']})")
        return a

    def _read_tensor_info(self, cur: _Cursor, i: int) -> tuple[str, int, tuple[int, ...], int]:
        name = cur.string(f"name of tensor #{i}")
        n_dims = cur.u32(f"dimension count of tensor '{name}'")
        if n_dims > MAX_DIMS:
            raise cur.fail(f"tensor '{name}' has {n_dims} dimensions; ggml allows at most {MAX_DIMS}")
        shape = tuple(cur.u64(f"dimension {d} of tensor '{name}'") for d in range(n_dims))
        ggml_type = cur.u32(f"type of tensor '{name}'")
        offset = cur.u64(f"data offset of tensor '{name}'")
        return name, ggml_type, shape, offset

    def _add_tensor(self, name: str, ggml_type: int, shape: tuple[int, ...], offset: int) -> None:
        where = f"{self.path}: tensor '{name}'"
        if name in self.tensors:
            raise CheckpointError(f"{where} appears twice in the tensor table")
        if ggml_type not in GGML_TYPES:
            raise UnsupportedFormatError(f"{where} has unknown ggml type id {ggml_type}; known: "
                                         f"{', '.join(n for n, _, _ in GGML_TYPES.values())}")
        type_name, block, type_size = GGML_TYPES[ggml_type]
        if shape and shape[0] % block:
            raise CheckpointError(f"{where}: {type_name} needs the first dimension to be a multiple of {block}, "
                                  f"found shape {list(shape)}")
        if offset % self.alignment:
            raise CheckpointError(f"{where}: data offset {offset} is not a multiple of the alignment {self.alignment}")
        nbytes = math.prod(shape) // block * type_size
        start = self.data_offset + offset
        if start + nbytes > self.size:
            raise CheckpointError(f"{self.path}: truncated GGUF file: tensor '{name}' ({type_name} {list(shape)}) "
                                  f"spans bytes {start}..{start + nbytes}, the file has {self.size}")
        self.tensors[name] = GGUFTensorInfo(name, ggml_type, shape, start, nbytes)

    # ---- access ------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default`` when the key is absent."""
        return self.metadata.get(key, default)

    def info(self, name: str) -> GGUFTensorInfo:
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: no tensor '{name}' in the file")
        return self.tensors[name]

    def raw(self, name: str) -> torch.Tensor:
        """uint8 ``[rows, row_bytes]`` (rows = product of ``ne[1:]``): a zero-copy view of the file."""
        info = self.info(name)
        rows = math.prod(info.shape[1:])
        if info.nbytes == 0:
            return torch.empty((rows, info.row_bytes), dtype=torch.uint8)
        t = torch.frombuffer(self._map, dtype=torch.uint8, count=info.nbytes, offset=info.offset)
        return t.view(rows, info.row_bytes)

    def array(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A plain (block size 1) tensor as ``dtype``, shaped ``torch_shape``; zero-copy."""
        info = self.info(name)
        elem = torch.empty((), dtype=dtype).element_size()
        if info.block_size != 1 or info.type_size != elem:
            raise CheckpointError(f"{self.path}: tensor '{name}' is {info.type_name}, not a plain {dtype} array")
        if info.nbytes == 0:
            return torch.empty(info.torch_shape, dtype=dtype)
        t = torch.frombuffer(self._map, dtype=dtype, count=info.nbytes // elem, offset=info.offset)
        return t.view(info.torch_shape)
