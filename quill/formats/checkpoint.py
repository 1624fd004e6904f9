"""Open a checkpoint (a safetensors directory or a GGUF file) and stream its layers in canonical form.

    ckpt = open_checkpoint("path/to/model")
    for name, qw in ckpt.quantized_layers():   # one layer unpacked at a time
        ...
    for name, tensor in ckpt.dense_tensors():  # everything else (embeddings, norms, unquantized linears)
        ...
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from quill.canonical import QuantizedWeight
from quill.errors import CheckpointError, ConfigError
from quill.formats.base import FormatReader, ModuleTensors
from quill.formats.registry import make_reader
from quill.formats.safetensors_io import TensorStore

# Stand-alone quantization config files older tools write beside config.json,
# with the quant_method to assume when the file does not say.
QUANT_CONFIG_FILES: tuple[tuple[str, str | None], ...] = (
    ("quantization_config.json", None),  # auto-round
    ("quantize_config.json", "gptq"),  # AutoGPTQ / GPTQModel
    ("quant_config.json", "awq"),  # AutoAWQ
)


def natural_key(name: str) -> tuple:
    """Sort 'layers.10' after 'layers.2'."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: {what} should be a JSON object")
    return data


def load_model_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json (a checkpoint directory needs one)")
    return read_json(path, "config.json")


def find_quant_config(directory: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's quantization_config, else a stand-alone quantization config file, else None (dense)."""
    qcfg = config.get("quantization_config")
    if qcfg is not None:
        if not isinstance(qcfg, dict):
            raise ConfigError(f"{directory}/config.json: quantization_config should be an object, found {qcfg!r}")
        return qcfg
    for name, method in QUANT_CONFIG_FILES:
        path = directory / name
        if path.is_file():
            qcfg = read_json(path, name)
            if "quant_method" not in qcfg and method is not None:
                qcfg = {**qcfg, "quant_method": method}
            return qcfg
    return None


class Checkpoint(Protocol):
    """What the loader and the engine read from any checkpoint (safetensors directory, GGUF file)."""

    path: Path
    config: dict[str, Any]  # HF config.json (for GGUF: built from its metadata)

    @property
    def quant_method(self) -> str | None: ...  # "gptq", "gguf", ... or None for a dense checkpoint

    def quantized_layers(self) -> Iterator[tuple[str, QuantizedWeight]]: ...  # one unpacked at a time

    def dense_tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...  # everything else

    def tokenizer_spec(self): ...  # quill.tokenizer_spec.TokenizerSpec, CheckpointError when absent

    def eos_token_ids(self) -> tuple[int, ...]: ...  # without loading a tokenizer

    def describe(self) -> str: ...


class SafetensorsCheckpoint:
    """A safetensors checkpoint directory: config, format reader and tensor store."""

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory")
        self.config = load_model_config(self.path)
        self.quant_config = find_quant_config(self.path, self.config)
        self.reader: FormatReader | None = (
            make_reader(self.quant_config, self.config) if self.quant_config is not None else None)
        self.store = TensorStore(self.path)
        self.plan = self._make_plan()

    def _make_plan(self) -> dict[str, list[str]]:
        if self.reader is None:
            return {}
        modules: dict[str, set[str]] = defaultdict(set)
        for name in self.store.names():
            module, _, suffix = name.rpartition(".")
            modules[module].add(suffix)
        plan = self.reader.plan({m: frozenset(s) for m, s in modules.items()})
        return {m: plan[m] for m in sorted(plan, key=natural_key)}

    @property
    def quant_method(self) -> str | None:
        return None if self.reader is None else self.reader.method

    def consumed(self) -> set[str]:
        sep = "." if self.reader is None else self.reader.suffix_separator
        return {f"{m}{sep}{s}" for m, suffixes in self.plan.items() for s in suffixes}

    def read_layer(self, module: str) -> QuantizedWeight:
        """Convert one quantized module (by name) into its canonical weight."""
        if module not in self.plan:
            raise CheckpointError(f"{self.path}: '{module}' is not a quantized layer of this checkpoint")
        tensors = ModuleTensors(module, self.plan[module], self.store.get, self.reader.suffix_separator)
        return self.reader.read(tensors).with_(name=module).validate()

    def quantized_layers(self) -> Iterator[tuple[str, QuantizedWeight]]:
        """Every quantized linear layer, in natural name order, one at a time."""
        for module in self.plan:
            yield module, self.read_layer(module)

    def dense_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor no quantized layer consumed (memory-mapped views)."""
        consumed = self.consumed()
        for name in sorted(self.store.names(), key=natural_key):
            if name not in consumed:
                yield name, self.store.get(name)

    def tokenizer_spec(self):
        """The tokenizer files of this directory as a ``TokenizerSpec`` (CheckpointError if absent)."""
        from quill.tokenizer import hf_tokenizer_spec
        return hf_tokenizer_spec(self.path, self.config)

    def eos_token_ids(self) -> tuple[int, ...]:
        """From generation_config.json and config.json (what a tokenizer-less run stops on)."""
        from quill.tokenizer import eos_token_ids
        return eos_token_ids(self.path, self.config)

    def describe(self) -> str:
        return "dense (no quantization_config)" if self.reader is None else self.reader.describe()


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """A checkpoint directory (safetensors) or a ``.gguf`` file, behind the same interface."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        from quill.formats.gguf.checkpoint import GGUFCheckpoint
        return GGUFCheckpoint(p)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    return SafetensorsCheckpoint(p)


def read_checkpoint(path: str | os.PathLike) -> Iterator[tuple[str, QuantizedWeight]]:
    """Yield ``(layer_name, QuantizedWeight)`` for every quantized linear layer of a checkpoint.

    Works for a single-file or sharded (``model.safetensors.index.json``)
    directory; tensors are memory-mapped and converted one layer at a time.
    """
    return open_checkpoint(path).quantized_layers()
