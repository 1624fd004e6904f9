"""A GGUF file behind the same interface as a safetensors :class:`Checkpoint`.

    ckpt = GGUFCheckpoint("model.Q4_1.gguf")     # or open_checkpoint(path)
    ckpt.config                                   # HF-style config built from the metadata
    for name, qw in ckpt.quantized_layers():      # Q4_0 / Q4_1 / Q8_0 -> canonical QuantizedWeight
        ...
    for name, t in ckpt.dense_tensors():          # F32 / F16 / BF16, HF names
        ...
    spec = ckpt.tokenizer_spec()

Names are Hugging Face's (``model.layers.0.self_attn.q_proj``), q/k rows are put
back in HF's order for the llama family, and a stacked MoE tensor
(``blk.N.ffn_up_exps``, ``[E, out, in]``) becomes one module per expert.  A
quantized ``token_embd`` comes out of ``quantized_layers()`` as
``model.embed_tokens``; without ``output.weight`` the config says
``tie_word_embeddings: true``.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from quill.canonical import QuantizedWeight
from quill.errors import CheckpointError, UnsupportedFormatError
from quill.formats.gguf.arch import (
    TensorName,
    arch_spec,
    build_config,
    converter_undo,
    map_name,
    qk_heads,
    unpermute_index,
)
from quill.formats.gguf.file import GGML_TYPES, GGUFFile
from quill.formats.gguf.quants import (
    DENSE_TYPES,
    QUANTIZED_TYPES,
    block_weight,
    check_supported,
)
from quill.formats.gguf.tokenizer import tokenizer_spec_from_gguf
from quill.tokenizer import eos_token_ids
from quill.tokenizer_spec import TokenizerSpec

# Tensors llama.cpp adds that HF models keep elsewhere: GGUF name -> quill's name for them.
# rope_freqs (Llama 3.1+ files): per-frequency divisors of RoPE's inverse frequencies (ggml_rope_ext's c).
_EXTRA_NAMES = {"rope_freqs.weight": "model.rotary_emb.freq_factors"}


def _natural_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


@dataclass(frozen=True)
class _Source:
    """Where one HF tensor comes from in the file."""

    gguf: str
    expert: int | None = None  # slice of a stacked [E, out, in] expert tensor
    heads: int | None = None  # llama q/k: un-interleave rows per head
    shape: tuple[int, ...] | None = None  # reshape a dense tensor to this HF shape
    undo: object = None  # the inverse of a change llama.cpp's converter made (arch.converter_undo)


class GGUFCheckpoint:
    """A ``.gguf`` file: config, quantized layers, dense tensors and tokenizer, all from the one file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.file = GGUFFile(self.path)
        meta = self.file.metadata
        arch = meta.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(f"{self.path}: GGUF metadata 'general.architecture' is missing or not a string")
        self.architecture = arch
        self.spec = arch_spec(arch, self.path)
        tokens = meta.get("tokenizer.ggml.tokens")
        self.config = build_config(meta, arch, self.file.tensors, len(tokens) if isinstance(tokens, list) else None,
                                   self.path, read=lambda name: self.file.array(
                                       name, DENSE_TYPES[self.file.info(name).ggml_type]))
        self._quantized: dict[str, tuple[_Source, _Source | None]] = {}
        self._dense: dict[str, _Source] = {}
        self._plan()
        counts = Counter(t.type_name for t in self.file.tensors.values())
        has_quant = any(t.ggml_type in QUANTIZED_TYPES for t in self.file.tensors.values())
        self.tensor_types = dict(counts)  # ggml type name -> tensor count
        # what `quill inspect` / tests read as the "quantization config" of a GGUF file
        self.quant_config = ({"quant_method": "gguf", "file_type": meta.get("general.file_type"),
                              "tensor_types": self.tensor_types} if has_quant else None)

    @property
    def quant_method(self) -> str | None:
        return None if self.quant_config is None else "gguf"

    # ---- planning: every tensor's HF name and role, before any data is read ----
    def _plan(self) -> None:
        is_moe = "num_experts" in self.config or "num_local_experts" in self.config
        named: list[tuple[TensorName, int, tuple[int, ...]]] = []
        for info in self.file.tensors.values():
            check_supported(info.ggml_type, info.name)
            if info.name in self.spec.in_config:
                continue
            if info.name in _EXTRA_NAMES:
                self._dense[_EXTRA_NAMES[info.name]] = _Source(info.name)
                continue
            named.append((map_name(info.name, self.spec, is_moe, self.path), info.ggml_type, info.shape))
        for tn, ggml_type, shape in named:
            if tn.suffix == "weight" and ggml_type in QUANTIZED_TYPES:
                self._expect_matrix(tn.gguf, ggml_type, shape)
                for module, src in self._sources(tn, shape):
                    self._quantized[module] = (src, None)
        for tn, ggml_type, shape in named:
            if tn.suffix == "weight" and ggml_type in QUANTIZED_TYPES:
                continue
            for module, src in self._sources(tn, shape):
                if tn.suffix == "bias" and module in self._quantized:  # a quantized layer's own bias
                    self._quantized[module] = (self._quantized[module][0], src)
                else:
                    self._dense[f"{module}.{tn.suffix}"] = src

    def _sources(self, tn: TensorName, shape: tuple[int, ...]) -> Iterator[tuple[str, _Source]]:
        """(HF module, source) for a tensor: one per expert for a stacked expert tensor."""
        heads = qk_heads(tn.gguf, self.config) if self.spec.permute_qk else None
        if tn.stacked_experts:
            n_experts = shape[-1] if shape else 0
            for e in range(n_experts):
                yield tn.hf(e).rpartition(".")[0], _Source(tn.gguf, expert=e)
            return
        # llama.cpp stores shared_expert_gate as a vector; HF's Linear(hidden, 1) weight is [1, hidden].
        reshape = (1, shape[0]) if tn.module.endswith("shared_expert_gate") and len(shape) == 1 else None
        yield tn.module, _Source(tn.gguf, heads=heads, shape=reshape, undo=converter_undo(tn.gguf, self.spec))

    def _expect_matrix(self, name: str, ggml_type: int, shape: tuple[int, ...]) -> None:
        if len(shape) not in (2, 3):
            raise UnsupportedFormatError(
                f"{self.path}: tensor '{name}' is {GGML_TYPES[ggml_type][0]} with shape {list(shape)}; quantized "
                "tensors are supported as 2-D matrices (or 3-D stacked experts) only")

    # ---- the Checkpoint interface ------------------------------------------------
    def consumed(self) -> set[str]:
        return {f"{m}.weight" for m in self._quantized} | {f"{m}.bias" for m, (_, b) in self._quantized.items() if b}

    @property
    def plan(self) -> dict[str, list[str]]:
        """Quantized module -> the suffixes it consumes, like ``Checkpoint.plan``."""
        return {m: ["weight"] + (["bias"] if b else []) for m, (_, b) in self._sorted(self._quantized)}

    @staticmethod
    def _sorted(d: dict) -> list:
        return sorted(d.items(), key=lambda kv: _natural_key(kv[0]))

    def read_layer(self, module: str) -> QuantizedWeight:
        """One quantized module (HF name) as a canonical weight, ``[out, in]``."""
        if module not in self._quantized:
            raise CheckpointError(f"{self.path}: '{module}' is not a quantized layer of this checkpoint")
        wsrc, bsrc = self._quantized[module]
        info = self.file.info(wsrc.gguf)
        raw = self.file.raw(wsrc.gguf)  # uint8 [rows, row_bytes]
        if wsrc.expert is not None:
            out = info.shape[1]
            raw = raw[wsrc.expert * out:(wsrc.expert + 1) * out]
        qw = block_weight(raw, info.ggml_type, module)
        if wsrc.heads is not None:  # rows of codes, scales and offsets together: exact
            qw = qw.take_rows(unpermute_index(qw.out_features, wsrc.heads, module))  # exact
        if bsrc is not None:
            qw = qw.with_(bias=self._load(bsrc).reshape(-1))  # _load un-permutes the bias itself
        return qw.validate()

    def quantized_layers(self) -> Iterator[tuple[str, QuantizedWeight]]:
        """Every quantized matrix, in natural HF-name order, one at a time."""
        for module, _ in self._sorted(self._quantized):
            yield module, self.read_layer(module)

    def dense_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every other tensor under its HF name: memory-mapped views (copies only where rows are permuted)."""
        for name, src in self._sorted(self._dense):
            yield name, self._load(src)

    def _load(self, src: _Source) -> torch.Tensor:
        info = self.file.info(src.gguf)
        t = self.file.array(src.gguf, DENSE_TYPES[info.ggml_type])  # [*ne reversed]
        if src.expert is not None:
            t = t[src.expert]
        if src.heads is not None:
            t = t.index_select(0, unpermute_index(t.shape[0], src.heads, src.gguf))
        if src.shape is not None:
            t = t.reshape(src.shape)
        if src.undo is not None:
            t = src.undo(t)
        return t

    def release_pages(self) -> None:
        """After loading: the file's pages are no longer resident (``GGUFFile.release_pages``)."""
        self.file.release_pages()

    def tokenizer_spec(self) -> TokenizerSpec:
        """The tokenizer stored in the file's metadata (``tokenizer.ggml.*``)."""
        return tokenizer_spec_from_gguf(self.file.metadata, self.path)

    def eos_token_ids(self) -> tuple[int, ...]:
        """From the metadata's config (what a tokenizer-less run stops on)."""
        return eos_token_ids(None, self.config)

    def describe(self) -> str:
        types = ", ".join(f"{n} x{c}" for n, c in sorted(self.tensor_types.items()))
        fmt = "dense" if self.quant_config is None else f"gguf ({types})"
        return f"{fmt}; {self.architecture} GGUF v{self.file.version}"
