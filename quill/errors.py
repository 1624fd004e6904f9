"""Typed errors. User input (checkpoints, configs, options) never fails with an assert.

Every message names what it is about (layer, tensor, field), what was found and
what is supported, so a user can act on it without reading quill's source.
"""

from __future__ import annotations


class QuillError(Exception):
    """Base class of every error quill raises on purpose."""


class CheckpointError(QuillError, ValueError):
    """A checkpoint's files or tensors are missing, truncated or malformed."""


class ConfigError(QuillError, ValueError):
    """A config field is invalid, or contradicts the tensors it describes."""


class UnsupportedFormatError(QuillError, ValueError):
    """A quantization method, bit width or layout that quill does not read."""


class KernelSelectionError(QuillError, RuntimeError):
    """No kernel can run a layer; the message lists every kernel's refusal."""


class KernelError(QuillError, RuntimeError):
    """A kernel was called with inputs that break its preconditions."""


class ModelError(QuillError, ValueError):
    """A model config or architecture quill cannot build."""


class GenerationError(QuillError, ValueError):
    """Invalid generation input: sampling parameters, prompts, context length."""


class CacheError(QuillError, ValueError):
    """A prepacked cache file that cannot be used (truncated, corrupt, or made for another kernel choice);
    it is rebuilt from the checkpoint, never used."""


class NotCacheable(QuillError):
    """A loaded model holds something the prepacked cache cannot save (it then loads uncached, as before)."""


class EvalError(QuillError, ValueError):
    """Bad evaluation input: empty text, a window the model cannot hold, a bad stride, a mismatched saved base."""


def format_choices(choices) -> str:
    """Render a collection of supported values for an error message."""
    return ", ".join(sorted(str(c) for c in choices))
