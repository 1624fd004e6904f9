"""What every format reader provides, and the helpers they share.

A reader knows one on-disk format and the canonical :class:`QuantizedWeight`,
nothing else: no kernels, no other formats.  The checkpoint drives it in two
steps:

1. ``plan(modules)``: given every module prefix of the checkpoint and the tensor
   suffixes stored under it, decide which modules are quantized linear layers
   and which tensor names each one consumes.  Contradictions between config
   and tensors are raised here, before any tensor data is read.
2. ``read(tensors)``: convert one module's tensors into a ``QuantizedWeight``.
   Called one module at a time, so only one layer is ever unpacked in memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from quill.canonical import QuantizedWeight
from quill.errors import CheckpointError, ConfigError

ModuleMap = Mapping[str, frozenset[str]]  # module prefix -> tensor suffixes stored under it


class ModuleTensors:
    """Typed, validating access to the tensors of one module (``<module>.<suffix>``)."""

    def __init__(self, module: str, suffixes: Sequence[str], load: Callable[[str], torch.Tensor], sep: str = "."):
        self.module = module
        self.suffixes = frozenset(suffixes)
        self._load = load
        self.sep = sep  # between module and suffix: '.' ('q_proj.qweight'), '_' for MXFP4's 'gate_up_proj_blocks'


    def has(self, suffix: str) -> bool:
        return suffix in self.suffixes

    def get(
        self,
        suffix: str,
        dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
        shape: Sequence[int | None] | None = None,
    ) -> torch.Tensor:
        """Load ``<module>.<suffix>``; check dtype and shape (``None`` in ``shape`` matches any size)."""
        name = f"{self.module}{self.sep}{suffix}"
        if suffix not in self.suffixes:
            raise CheckpointError(f"layer {self.module}: tensor '{name}' is missing from the checkpoint")
        t = self._load(name)
        if dtype is not None:
            allowed = dtype if isinstance(dtype, tuple) else (dtype,)
            if t.dtype not in allowed:
                raise CheckpointError(
                    f"layer {self.module}: tensor '{name}' has dtype {t.dtype}, expected "
                    f"{' or '.join(str(d) for d in allowed)}")
        if shape is not None:
            ok = len(shape) == t.dim() and all(s is None or s == d for s, d in zip(shape, t.shape))
            if not ok:
                want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
                raise CheckpointError(
                    f"layer {self.module}: tensor '{name}' has shape {list(t.shape)}, expected {want}")
        return t

    def get_optional(self, suffix: str, **checks) -> torch.Tensor | None:
        return self.get(suffix, **checks) if self.has(suffix) else None


class FormatReader(ABC):
    """One on-disk quantization format -> canonical ``QuantizedWeight``.

    Subclasses parse and validate their ``quantization_config`` in ``__init__``
    (raising :class:`ConfigError` naming the field) and implement ``plan`` and
    ``read``.
    """

    method: ClassVar[str]  # canonical quant_method name, e.g. "gptq"
    suffix_separator: ClassVar[str] = "."  # a planned module's tensors are '<module><sep><suffix>'

    def __init__(self, qcfg: Mapping[str, Any], model_config: Mapping[str, Any]):
        self.qcfg = dict(qcfg)
        self.model_config = dict(model_config)

    @abstractmethod
    def plan(self, modules: ModuleMap) -> dict[str, list[str]]:
        """Quantized modules of this checkpoint -> the tensor suffixes each consumes."""

    @abstractmethod
    def read(self, tensors: ModuleTensors) -> QuantizedWeight:
        """Convert one module's tensors into a canonical weight (``name`` is set by the caller)."""

    def describe(self) -> str:
        """One line for ``quill inspect``: the format and its global settings."""
        return self.method


# ---- config helpers shared by readers -------------------------------------

def config_field(cfg: Mapping[str, Any], names: str | Sequence[str], kind: type | tuple[type, ...],
                 default: Any = ..., where: str = "quantization_config") -> Any:
    """Read a config field (first of several spellings) and check its type."""
    names = (names,) if isinstance(names, str) else tuple(names)
    for n in names:
        if n in cfg and cfg[n] is not None:
            v = cfg[n]
            kinds = kind if isinstance(kind, tuple) else (kind,)
            if isinstance(v, bool) and bool not in kinds:
                raise ConfigError(f"{where}.{n}: expected {_kind_name(kinds)}, found {v!r}")
            if not isinstance(v, kinds):
                raise ConfigError(f"{where}.{n}: expected {_kind_name(kinds)}, found {v!r}")
            return v
    if default is ...:
        raise ConfigError(f"{where}: required field '{names[0]}' is missing")
    return default


def _kind_name(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)


def check_bits(bits: int, supported: Sequence[int], where: str) -> int:
    if bits not in supported:
        raise ConfigError(f"{where}: bits={bits} is not supported; supported: {', '.join(map(str, supported))}")
    return bits


def resolve_group_size(group_size: int, in_features: int, layer: str) -> int:
    """-1 (or 0) means per-channel; otherwise it must divide in_features."""
    if group_size in (-1, 0):
        return in_features
    if group_size < 0 or in_features % group_size:
        raise ConfigError(
            f"layer {layer}: group_size {group_size} does not divide in_features {in_features}; "
            "supported: -1 (per-channel) or a divisor of in_features")
    return group_size
