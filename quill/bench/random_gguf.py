"""Random-weight GGUF files written tensor by tensor, as llama.cpp's tools leave them: what the benchmarks on
model shapes nobody ships at random (quill.bench.qwen35, quill.bench.windowed) share.

A file is a list of ``TensorSpec`` (name, numpy shape, type: a float type for what the converter writes, or a
ggml block type for what llama.cpp's quantizer would have written) and a metadata callback; the data comes from
a callback too, one tensor at a time, so memory stays at the largest tensor whatever the file's size.  The
tokenizer is copied from a small GGUF (SmolLM2's, the default model's) and padded with unused tokens to the
architecture's vocabulary size, so the embedding and the lm_head have their real size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order (rows last-but-one): ggml's ne reversed
    dtype: object  # np.float16 / np.float32, or a gguf.GGMLQuantizationType (the data is then its raw blocks)

    @property
    def count(self) -> int:
        return int(np.prod(self.shape))

    def nbytes(self) -> int:
        if self.dtype in (np.float16, np.float32):
            return self.count * np.dtype(self.dtype).itemsize
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[self.dtype]
        return self.count // block * size

    def byte_shape(self) -> tuple[int, ...]:
        """The uint8 array a quantized tensor is written as (the last dim in blocks' bytes)."""
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[self.dtype]
        if self.shape[-1] % block:
            raise ValueError(f"{self.name}: rows of {self.shape[-1]} are not whole {block}-wide blocks")
        return (*self.shape[:-1], self.shape[-1] // block * size)


def bf16_values(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to the nearest bfloat16 values (ties to even, as torch's ``.to(torch.bfloat16)``)."""
    u = x.astype(np.float32).view(np.uint32)
    u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return u.view(np.float32)


def uniform(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """float32 values uniform in a range of standard deviation ``std`` (uniform: twice as fast to draw as normal)."""
    x = rng.random(shape, dtype=np.float32)
    x -= np.float32(0.5)
    x *= np.float32(12 ** 0.5 * std)
    return x


def copy_tokenizer(w, tokenizer_from: Path, vocab: int) -> None:
    """``tokenizer_from``'s tokenizer keys, its token list padded with UNUSED tokens to ``vocab`` entries."""
    import gguf

    from quill.formats.gguf.file import GGUFFile

    src = GGUFFile(tokenizer_from)  # quill's reader: a fraction of gguf-py's time on a 49k-token vocabulary
    for key, value in src.metadata.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = src.value_types[key]
        sub = gguf.GGUFValueType[vtype[1].upper()] if isinstance(vtype, tuple) else None
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            if len(value) > vocab:
                raise ValueError(f"{tokenizer_from} has {len(value)} tokens, more than the {vocab} asked for")
            pad = vocab - len(value)
            value = value + ([f"<|quill_unused_{i}|>" for i in range(pad)] if key.endswith("tokens")
                             else [int(gguf.TokenType.UNUSED)] * pad if key.endswith("token_type") else [0.0] * pad)
        w.add_key_value(key, value, gguf.GGUFValueType.ARRAY if sub else gguf.GGUFValueType[vtype.upper()],
                        sub_type=sub)


def write_gguf(path: Path, arch: str, specs: list[TensorSpec], metadata: Callable[[object], None],
               data: Callable[[np.random.Generator, TensorSpec], np.ndarray], seed: int = 0) -> Path:
    """``path`` with ``specs``' tensors, in that order; ``metadata(writer)`` adds every key after the tensor infos
    are known (the converter's size label counts them); ``data(rng, spec)`` gives each tensor's values (float
    types) or raw blocks (uint8, ``spec.byte_shape()``).  Written under ``.part`` and renamed: once, never half."""
    import gguf

    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(str(tmp), arch)
    for s in specs:
        if s.dtype in (np.float16, np.float32):
            w.add_tensor_info(s.name, s.shape, np.dtype(s.dtype), s.nbytes())
        else:
            w.add_tensor_info(s.name, s.byte_shape(), np.dtype(np.uint8), s.nbytes(), raw_dtype=s.dtype)
    metadata(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for s in specs:
        x = data(rng, s)
        want = s.shape if s.dtype in (np.float16, np.float32) else s.byte_shape()
        if x.shape != want:  # the writer checks only the byte count
            raise ValueError(f"{s.name}: data of shape {x.shape}, expected {want}")
        w.write_tensor_data(x.astype(s.dtype, copy=False) if s.dtype in (np.float16, np.float32) else x)
    w.close()
    tmp.rename(path)
    return path


def quantize_source(write_source: Callable[[], Path], targets: dict[str, Path], llama_python: str,
                    keep_source: bool = False, log=print) -> list[Path]:
    """``targets`` (llama.cpp ftype, e.g. ``q4_k_m`` -> path): each one missing is made by llama.cpp's own
    quantizer from the float file ``write_source()`` writes (only when one is missing); that source is deleted
    after, unless ``keep_source`` (a 1B model's F16 file is 2 GB, a small disk holds few)."""
    import time

    from quill.bench.llamacpp import quantize_with_llamacpp

    if all(p.exists() for p in targets.values()):
        return list(targets.values())
    t0 = time.perf_counter()
    src = write_source()
    log(f"{src.name}: {src.stat().st_size / 1e9:.2f} GB, written in {time.perf_counter() - t0:.1f} s")
    for ftype, dst in targets.items():
        t0 = time.perf_counter()
        quantize_with_llamacpp(llama_python, src, dst, ftype)
        log(f"{dst.name}: {dst.stat().st_size / 1e9:.2f} GB, quantized in {time.perf_counter() - t0:.1f} s")
    if not keep_source:
        src.unlink()
    return list(targets.values())
