"""Writing small GGUF files for tests: through the ``gguf`` package (the oracle), or byte by byte."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf import GGUFWriter
from gguf.quants import quantize

__all__ = ["T", "V", "llama_permute", "pack_string", "raw_gguf", "without_tokenizer", "write_gguf"]


def write_gguf(path: Path, arch: str, kv=(), tensors=(), alignment: int | None = None) -> Path:
    """``kv``: (key, value, vtype[, sub_type]); ``tensors``: (name, array [.., out, in], ggml type).

    Float arrays are quantized by the gguf package itself for quantized and BF16 types; uint8
    arrays are taken as already packed blocks.
    """
    w = GGUFWriter(str(path), arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value, vtype, *sub in kv:
        w.add_key_value(key, value, vtype, sub[0] if sub else None)
    for name, data, qtype in tensors:
        if data.dtype == np.uint8:  # already packed blocks, [rows, row_bytes]
            w.add_tensor(name, data, raw_dtype=qtype)
            continue
        data = np.ascontiguousarray(data, dtype=np.float32)
        if qtype == T.F32:
            w.add_tensor(name, data)
        elif qtype == T.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def without_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of ``src`` without its vocabulary (the ``tokenizer.*`` arrays: tokens, scores, types, merges;
    the special token ids stay), tensors byte for byte: for an oracle that reads token ids only (gguf-py
    spends most of a small model's load parsing a 49k-token vocabulary, twice per transformers load)."""
    from quill.formats.gguf.file import GGUFFile

    if dst.exists():
        return dst
    f = GGUFFile(src)
    arch = f.get("general.architecture")
    w = GGUFWriter(str(dst), arch)
    kinds = {bool: V.BOOL, int: V.UINT32, float: V.FLOAT32, str: V.STRING}
    for key, value in f.metadata.items():
        if (key.startswith("tokenizer.") and isinstance(value, list)) or key in ("general.architecture",
                                                                                   "GGUF.version"):
            continue
        if isinstance(value, list):
            w.add_key_value(key, value, V.ARRAY, kinds[type(value[0])])
        else:
            w.add_key_value(key, value, kinds[type(value)])
    for info in f.tensors.values():
        raw = f.raw(info.name).numpy().reshape(*info.torch_shape[:-1], info.row_bytes)
        w.add_tensor(info.name, raw, raw_dtype=T(info.ggml_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py): HF q/k rows -> GGUF rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- byte-level construction, for corrupt and edge-case files -----------------------

def pack_string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def raw_gguf(kvs=(), tensors=(), data: bytes = b"", version: int = 3, alignment: int = 32,
             magic: bytes = b"GGUF") -> bytes:
    """A GGUF file from parts: ``kvs`` (key, vtype, payload bytes); ``tensors`` (name, ne, ggml type, offset)."""
    out = bytearray(magic + struct.pack("<IQQ", version, len(tensors), len(kvs)))
    for key, vtype, payload in kvs:
        out += pack_string(key) + struct.pack("<I", vtype) + payload
    for name, ne, ggml_type, offset in tensors:
        out += pack_string(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        out += struct.pack("<IQ", ggml_type, offset)
    out += b"\0" * (-len(out) % alignment)
    return bytes(out) + data


# ---- random blocks of any supported quantized type ------------------------------------

# type -> byte offsets of its f16 fields (d, and dmin / m): set to sane finite values
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
              "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0, scale: float = 1e-3) -> np.ndarray:
    """uint8 [rows, row_bytes]: random blocks of ``type_name`` for a [rows, cols] matrix, f16 scale fields
    drawn from +-[scale, 4 * scale] (so weights stay O(scale * code))."""
    from quill.formats.gguf.file import GGML_TYPE_IDS, GGML_TYPES

    _, block, size = GGML_TYPES[GGML_TYPE_IDS[type_name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for at in F16_FIELDS[type_name]:
        d = (rng.uniform(1, 4, size=raw.shape[:2]) * scale * rng.choice([-1, 1], size=raw.shape[:2]))
        raw[..., at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)
