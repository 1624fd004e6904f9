"""The interface every MoE backend implements (the mirror of :mod:`quill.kernels.base`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from quill.moe.config import MoELayerConfig
from quill.moe.experts import ExpertWeights, Proj
from quill.platform import Platform

# Builds one run-time linear (x [n, in] -> y [n, out]) from a canonical projection,
# through the linear-kernel selector; supplied by whoever builds the layer.
LinearFactory = Callable[[Proj], Callable[[torch.Tensor], torch.Tensor]]


class MoEBackend(ABC):
    """A way to compute the routed experts of one MoE layer.

    Backends are stateless classes; ``prepare`` returns the per-layer state
    (the experts repacked or stacked once, after loading) that ``apply``
    consumes.  ``supported`` and ``can_implement`` return ``None`` when the
    backend can run, otherwise a one-line reason that names the limit.
    """

    name: ClassVar[str]

    @classmethod
    def supported(cls, platform: Platform) -> str | None:
        """Why this backend cannot run on ``platform`` at all, or None."""
        return None

    @classmethod
    @abstractmethod
    def can_implement(cls, cfg: MoELayerConfig) -> str | None:
        """Why this backend cannot run a layer described by ``cfg``, or None."""

    @classmethod
    @abstractmethod
    def prepare(cls, experts: Sequence[ExpertWeights], cfg: MoELayerConfig, make_linear: LinearFactory) -> Any:
        """Repack/stack the experts once (after loading); return the layer state."""

    @classmethod
    def export_state(cls, state: Any, export_linear: Callable) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """``state`` as JSON-able facts and tensors (the prepacked cache; ``export_linear`` saves one built
        linear), or None when it cannot be saved."""
        return None

    @classmethod
    def restore_state(cls, facts: dict, tensors: dict[str, torch.Tensor], cfg: MoELayerConfig,
                      restore_linear: Callable[[dict, dict[str, torch.Tensor]], Any]) -> Any:
        """The state :meth:`export_state` described, around ``tensors`` as they are."""
        raise NotImplementedError(f"MoE backend {cls.name} does not restore a saved state")

    @classmethod
    @abstractmethod
    def apply(cls, state: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H] float, topk_ids int64 [T, k], topk_weights float32 [T, k] -> y [T, H] in x's dtype.

        ``y[t] = sum_j topk_weights[t, j] * expert[topk_ids[t, j]](x[t])``.
        """
