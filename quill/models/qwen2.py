"""Qwen2 (HF ``model_type`` qwen2): the Llama decoder with biases on q/k/v (not on o)."""

from __future__ import annotations

from dataclasses import dataclass

from quill.models import llama
from quill.models.base import sliding_window_limit


@dataclass
class ModelArgs(llama.ModelArgs):
    use_sliding_window: bool = False
    max_window_layers: int | None = None

    @property
    def context_length(self) -> int:
        return sliding_window_limit(self.sliding_window, self.use_sliding_window, self.max_position_embeddings)


class Model(llama.Model):
    qkv_bias = True
