"""Qwen2 (HF ``model_type`` qwen2): the Llama decoder with biases on q/k/v (not on o)."""

from __future__ import annotations

from dataclasses import dataclass

from quill.errors import ModelError
from quill.models import llama


@dataclass
class ModelArgs(llama.ModelArgs):
    use_sliding_window: bool = False
    max_window_layers: int | None = None
    layer_types: list | None = None

    def layer_window(self, layer: int) -> int | None:
        """transformers' Qwen2 convention: no window unless ``use_sliding_window``; then ``layer_types`` says
        which layers are local, or, without it, the layers from ``max_window_layers`` on are."""
        if not self.use_sliding_window or self.sliding_window is None:
            return None
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ModelError(f"config field 'layer_types': {len(self.layer_types)} entries for "
                                 f"{self.num_hidden_layers} layers")
            local = self.layer_types[layer] == "sliding_attention"
        else:
            local = layer >= (self.max_window_layers if self.max_window_layers is not None else 28)
        return super().layer_window(layer) if local else None


class Model(llama.Model):
    qkv_bias = True
