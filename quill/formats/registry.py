"""Format registry: ``quant_method`` -> reader class, with aliases and deprecated names.

Readers are imported lazily so that a broken optional reader cannot stop the
others from loading.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from typing import Any

from quill.errors import UnsupportedFormatError, format_choices
from quill.formats.base import FormatReader

# canonical quant_method -> "module:Class"
READERS: dict[str, str] = {
    "gptq": "quill.formats.gptq:GPTQReader",
    "awq": "quill.formats.awq:AWQReader",
    "compressed-tensors": "quill.formats.compressed_tensors.reader:CompressedTensorsReader",
    "auto-round": "quill.formats.autoround:AutoRoundReader",
    "mxfp4": "quill.formats.mxfp4:MXFP4Reader",
}

# Other spellings of the same formats, accepted silently.
ALIASES: dict[str, str] = {
    "auto_gptq": "gptq",
    "autogptq": "gptq",
    "auto_awq": "awq",
    "autoawq": "awq",
    "compressed_tensors": "compressed-tensors",
    "intel/auto-round": "auto-round",
    "auto_round": "auto-round",
    "autoround": "auto-round",
}

# Names that used to be valid (here or in the source system) and still load, with a warning.
DEPRECATED: dict[str, tuple[str, str]] = {
    "cpu_awq": ("awq", "vLLM's CPU-only AWQ method, removed when CPU AWQ moved into awq_marlin (vLLM #43841)"),
    "awq_marlin": ("awq", "a GPU kernel name, not a checkpoint format"),
    "gptq_marlin": ("gptq", "a GPU kernel name, not a checkpoint format"),
    "inc": ("auto-round", "vLLM's internal name for Intel Neural Compressor / AutoRound checkpoints"),
}


class QuillDeprecationWarning(UserWarning):
    """A deprecated or renamed name was used; it still works (shown by default, unlike DeprecationWarning)."""


def canonical_method(name: str) -> str:
    """Normalize a ``quant_method`` to a registered reader name (warning for deprecated names)."""
    key = str(name).strip().lower()
    if key in READERS:
        return key
    if key in ALIASES:
        return ALIASES[key]
    if key in DEPRECATED:
        target, why = DEPRECATED[key]
        warnings.warn(
            f"quant_method '{name}' is deprecated ({why}); loading it as '{target}'. "
            f"Write quant_method '{target}' to silence this warning.",
            QuillDeprecationWarning, stacklevel=3)
        return target
    known = list(READERS) + list(ALIASES) + list(DEPRECATED)
    raise UnsupportedFormatError(
        f"quantization_config.quant_method '{name}' is not supported; supported: {format_choices(READERS)} "
        f"(also accepted: {format_choices(set(known) - set(READERS))})")


def reader_class(method: str) -> type[FormatReader]:
    module, cls = READERS[method].split(":")
    return getattr(importlib.import_module(module), cls)


def make_reader(qcfg: Mapping[str, Any], model_config: Mapping[str, Any]) -> FormatReader:
    """The reader for a ``quantization_config`` (whose ``quant_method`` must be set by the caller)."""
    if "quant_method" not in qcfg:
        raise UnsupportedFormatError("quantization_config has no 'quant_method'; cannot tell the format")
    method = canonical_method(qcfg["quant_method"])
    return reader_class(method)(qcfg, model_config)
