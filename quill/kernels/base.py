"""The interface every linear kernel implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from quill.canonical import ActivationQuant, QuantizedWeight
from quill.errors import KernelError
from quill.kernels.config import LinearLayerConfig
from quill.platform import Platform


class LinearKernel(ABC):
    """A way to compute ``y = x @ W^T + b`` for a quantized ``W``.

    Kernels are stateless classes; ``prepare`` returns the per-layer state
    (the weight repacked once into the kernel's own layout) that ``apply``
    consumes.  ``supported`` and ``can_implement`` return ``None`` when the
    kernel can run, otherwise a one-line reason that names the limit.
    """

    name: ClassVar[str]
    # True: ``prepare`` reads two-level scales itself; False: it gets ``weight.single_level()``
    two_level_scales: ClassVar[bool] = False
    # True: ``prepare`` reads codebook codes (MXFP4) itself; False: it gets ``weight.uniform()`` and
    # ``can_implement`` is asked about ``cfg.as_uniform()``
    codebook_codes: ClassVar[bool] = False

    @classmethod
    def supported(cls, platform: Platform) -> str | None:
        """Why this kernel cannot run on ``platform`` at all (missing ISA, library), or None."""
        return None

    @classmethod
    @abstractmethod
    def can_implement(cls, cfg: LinearLayerConfig) -> str | None:
        """Why this kernel cannot run a layer described by ``cfg``, or None."""

    @classmethod
    @abstractmethod
    def prepare(cls, weight: QuantizedWeight, cfg: LinearLayerConfig) -> Any:
        """Repack ``weight`` once (after loading) into this kernel's layout; return the layer state."""

    @classmethod
    @abstractmethod
    def apply(cls, state: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in_features] float -> y [..., out_features] in x's dtype."""

    @classmethod
    def export_state(cls, state: Any) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """``state`` as JSON-able facts and tensors (for the prepacked cache), or None when this kernel's
        state cannot be saved (the model is then not cached)."""
        return None

    @classmethod
    def restore_state(cls, facts: dict, tensors: dict[str, torch.Tensor], cfg: LinearLayerConfig,
                      activation: ActivationQuant | None, name: str) -> Any:
        """The state :meth:`export_state` described, rebuilt around ``tensors`` (already in place, not copied)."""
        raise KernelError(f"{name}: kernel {cls.name} cannot restore a saved state")

    @classmethod
    def state_bytes(cls, state: Any) -> int:
        """Bytes of weight data the state holds (for inspect/benchmarks)."""
        total = 0
        for v in vars(state).values() if hasattr(state, "__dict__") else ():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
        return total
