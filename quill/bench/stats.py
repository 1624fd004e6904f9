"""The statistics benchmarks and tests share: signal-to-quantization-noise ratio, medians."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # median() serves `quill bench --help`'s modules, which must not load torch
    import torch


def sqnr(y: torch.Tensor, ref: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |y - ref|^2) in dB, computed in float64; inf when ``y`` equals ``ref``."""
    import torch

    ref, y = ref.double(), y.double()
    noise = (y - ref).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).sum() / noise))


def sqnr_db(ref: torch.Tensor, y: torch.Tensor) -> float:
    """:func:`sqnr` with the reference first."""
    return sqnr(y, ref)


def median(values: Iterable[float]) -> float:
    """The median of several timed runs (what every benchmark reports)."""
    return float(statistics.median(list(values)))
