"""Checkpoint formats -> the canonical quantized weight."""

from quill.quantization.checkpoint import Checkpoint, open_checkpoint, read_checkpoint
from quill.quantization.weight import ActivationQuant, QuantizedWeight

__all__ = ["ActivationQuant", "Checkpoint", "QuantizedWeight", "open_checkpoint", "read_checkpoint"]
