"""Memory-mapped, validated safetensors access (single file or sharded with an index).

No pickle anywhere: a safetensors file is an 8-byte little-endian header length,
a JSON header {name: {dtype, shape, data_offsets: [begin, end]}} and the raw
bytes.  Tensors come back as zero-copy views of a private (copy-on-write) memory
map, so reading one tensor touches only its own pages.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from quill.errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives and what it is, read from the header only."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    begin: int  # absolute byte offset in the file
    end: int


class SafetensorsFile:
    """One .safetensors file: header parsed and checked against the file size at open."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._map: mmap.mmap | None = None
        self.metadata: dict[str, str] = {}
        self.tensors: dict[str, TensorInfo] = self._read_header()

    def _read_header(self) -> dict[str, TensorInfo]:
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path}: truncated safetensors file ({size} bytes, no header length)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{self.path}: truncated or corrupt safetensors file: header claims {n} bytes, "
                    f"file has {size}")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{self.path}: safetensors header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: safetensors header should be a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        data_start = 8 + n
        return {name: self._entry(name, e, data_start, size) for name, e in header.items()}

    def _entry(self, name: str, e: dict, data_start: int, size: int) -> TensorInfo:
        where = f"{self.path}: tensor '{name}'"
        try:
            dtype_name, shape, (b, end) = e["dtype"], e["shape"], e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{where}: header entry should have dtype, shape, data_offsets; found {e}") from None
        if dtype_name not in DTYPES:
            raise CheckpointError(f"{where}: dtype {dtype_name} is not supported; supported: {sorted(DTYPES)}")
        dtype = DTYPES[dtype_name]
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - b != nbytes or b < 0:
            raise CheckpointError(f"{where}: data_offsets [{b}, {end}] do not match {dtype_name} {shape} "
                                  f"({nbytes} bytes)")
        if data_start + end > size:
            raise CheckpointError(
                f"{where}: truncated file: tensor ends at byte {data_start + end}, file has {size}")
        return TensorInfo(name, dtype, tuple(shape), self.path, data_start + b, data_start + end)

    def get(self, name: str) -> torch.Tensor:
        """A zero-copy tensor backed by the file's memory map."""
        info = self.tensors[name]
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        count = math.prod(info.shape)
        if count == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        t = torch.frombuffer(self._map, dtype=info.dtype, count=count, offset=info.begin)
        return t.reshape(info.shape)


class TensorStore:
    """All tensors of a checkpoint directory, by name, across shards."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.files: list[SafetensorsFile] = [SafetensorsFile(p) for p in self._shard_paths()]
        self._where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.tensors:
                if name in self._where:
                    raise CheckpointError(f"{self.directory}: tensor '{name}' appears in {self._where[name].path.name} "
                                          f"and {f.path.name}")
                self._where[name] = f
        self._check_index()

    def _shard_paths(self) -> list[Path]:
        index = self.directory / INDEX_NAME
        if index.is_file():
            self._index = self._read_index(index)
            names = sorted(set(self._index.values()))
            missing = [n for n in names if not (self.directory / n).is_file()]
            if missing:
                raise CheckpointError(f"{index}: names shard files that do not exist: {missing}")
            return [self.directory / n for n in names]
        self._index = None
        single = self.directory / SINGLE_NAME
        if single.is_file():
            return [single]
        found = sorted(self.directory.glob("*.safetensors"))
        if not found:
            raise CheckpointError(f"{self.directory}: no safetensors weights found (looked for {INDEX_NAME}, "
                                  f"{SINGLE_NAME}, *.safetensors)")
        return found

    @staticmethod
    def _read_index(index: Path) -> dict[str, str]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: should be JSON with a 'weight_map' object ({e})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' should map tensor names to shard files")
        return weight_map

    def _check_index(self) -> None:
        if self._index is None:
            return
        for name, shard in self._index.items():
            f = self._where.get(name)
            if f is None or f.path.name != shard:
                raise CheckpointError(f"{self.directory / INDEX_NAME}: tensor '{name}' should be in {shard}, "
                                      f"found {'nowhere' if f is None else f.path.name}")

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def info(self, name: str) -> TensorInfo:
        return self._where[name].tensors[name]

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointError(f"{self.directory}: tensor '{name}' is missing from the checkpoint")
        return self._where[name].get(name)
