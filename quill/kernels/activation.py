"""Run-time int8 quantization of activations: the arithmetic every int8 kernel must reproduce.

It follows compressed-tensors (whose checkpoints define W8A8 semantics), so a
W8A8 checkpoint runs as the tool that wrote it ran it:

* dynamic symmetric, per token (row):  scale = max|x_row| / 127.5, zero = 0
* dynamic asymmetric, per token:       lo = min(min(x_row), 0), hi = max(max(x_row), 0),
                                       scale = (hi - lo) / 255, zero = round(clamp(-128 - lo / scale, -128, 127))
* dynamic symmetric, per token and group (``per_group``, llama.cpp's int8 blocks): the same
  formula over each weight group's columns of a row, scale [M, G]
* static, per tensor:                  the checkpoint's scale (and zero point)
* then  q = round(clamp(x / scale + zero, -128, 127))  (round half to even), int8

A zero scale is replaced by float32 epsilon (as compressed-tensors does), so an
all-zero row quantizes to zeros.  (compressed-tensors derives the asymmetric zero
point before that replacement, from 0/0; only all-zero rows have a zero scale and
they give 0 with any zero point, so the results agree.)  Everything is computed in
float32; compressed-tensors computes in the input's dtype, the same thing for the
float32 inputs tests/test_conformance_ct.py checks against its formula.
"""

from __future__ import annotations

import torch

from quill.canonical import ActivationQuant

QMIN, QMAX = -128, 127
_EPS = torch.finfo(torch.float32).eps


def _fix_zero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.full_like(scale, _EPS), scale)


def activation_qparams(x: torch.Tensor, act: ActivationQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 scale and zero point for ``x`` [M, K]: shapes [M, 1] (dynamic) or [1, 1] (static)."""
    x = x.float()
    if not act.dynamic:
        scale = torch.tensor([[act.scale]], dtype=torch.float32)
        zero = torch.tensor([[float(act.zero_point or 0)]], dtype=torch.float32)
        return _fix_zero(scale), zero
    if act.symmetric:
        scale = x.abs().amax(dim=-1, keepdim=True) / ((QMAX - QMIN) / 2)
        return _fix_zero(scale), torch.zeros_like(scale)
    lo = x.amin(dim=-1, keepdim=True).clamp_max(0)
    hi = x.amax(dim=-1, keepdim=True).clamp_min(0)
    scale = _fix_zero((hi - lo) / (QMAX - QMIN))
    zero = torch.round(torch.clamp(QMIN - lo / scale, QMIN, QMAX))
    return scale, zero


def group_scales(x: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Per-group symmetric scales: x [M, K], groups int64 [K] (each column's weight group) -> float32 [M, G]."""
    x = x.float()
    amax = torch.zeros(x.shape[0], int(groups.max()) + 1).scatter_reduce_(
        1, groups.expand(x.shape[0], -1), x.abs(), "amax", include_self=True)
    return _fix_zero(amax / ((QMAX - QMIN) / 2))


def quantize_activations(x: torch.Tensor, act: ActivationQuant,
                         groups: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (q int8 [M, K], scale float32, zero float32) per :func:`activation_qparams`;
    with ``act.per_group``, ``groups`` (int64 [K], the weight group of every column) is required and the
    scale comes back per column, [M, K] (zero 0)."""
    if act.per_group:
        if groups is None:
            raise ValueError("per-group activation quantization needs the weight's column groups")
        scale = group_scales(x, groups)[:, groups]  # [M, K]
        zero = torch.zeros(1, 1)
    else:
        scale, zero = activation_qparams(x, act)
    q = torch.round(torch.clamp(x.float() / scale + zero, QMIN, QMAX))
    return q.to(torch.int8), scale, zero


def fake_quantize_activations(x: torch.Tensor, act: ActivationQuant,
                              groups: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize then dequantize ``x`` (float32 result): what an exact int8 kernel sees."""
    q, scale, zero = quantize_activations(x, act, groups)
    return (q.float() - zero) * scale
