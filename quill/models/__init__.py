"""Model architectures, one module per HF ``model_type``, resolved by name.

Each module defines ``ModelArgs`` (a dataclass with ``from_dict``) and ``Model``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from quill.errors import ModelError

# model_type -> module under quill.models implementing it
ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",  # dense Mistral is the Llama decoder (its sliding window on every layer)
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "gemma3_text": "gemma3",  # local sliding-window layers between global ones
    "gemma3": "gemma3",  # the multimodal checkpoint's text model (its vision tower skipped)
    "gemma4_text": "gemma4",  # per-layer input embeddings, KV-shared layers, wider global heads
    "gemma4": "gemma4",  # the multimodal checkpoint's text model (its vision and audio towers skipped)
    "qwen3_5_text": "qwen3_5",  # hybrid: Gated DeltaNet layers beside gated attention
    "qwen3_5": "qwen3_5",  # the multimodal checkpoint's text model (its vision tower skipped)
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_5_moe": "qwen3_5_moe",
    "gpt_oss": "gpt_oss",  # routed experts with attention sinks, sliding layers between full ones
}


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


def model_module(model_type: str | None) -> ModuleType:
    """The module implementing ``model_type``, or a ModelError listing the supported ones."""
    if model_type not in ARCHITECTURES:
        raise ModelError(f"config model_type '{model_type}' is not supported; supported: "
                         f"{', '.join(supported_model_types())}")
    return importlib.import_module(f"quill.models.{ARCHITECTURES[model_type]}")
