"""The experts of one MoE layer in canonical form, whatever format they were stored in.

Each expert is a gated MLP ``down(act(gate(x)) * up(x))`` whose three
projections are either a canonical :class:`QuantizedWeight` (any reader's
output) or a :class:`DenseWeight` (a float tensor the checkpoint left
unquantized).  Nothing here knows a source format.

Stacking gate and up into one ``[2 * I, H]`` weight is exact: the rows of a
canonical weight are independent (each has its own scales, zero points and
offsets per group), so concatenating rows computes the same two products in
one call and reads the shared input once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quill.canonical import QuantizedWeight
from quill.errors import CheckpointError, ConfigError

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(eq=False)
class DenseWeight:
    """An unquantized projection: float ``weight`` [out, in] (any float dtype) and optional ``bias`` [out]."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    name: str = "<unnamed>"

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def storage_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in] (the same accessor a QuantizedWeight has)."""
        return self.weight.float()


Proj = QuantizedWeight | DenseWeight


@dataclass(eq=False)
class ExpertWeights:
    """One expert: ``gate`` and ``up`` [I, H], ``down`` [H, I]."""

    gate: Proj
    up: Proj
    down: Proj

    def storage_bytes(self) -> int:
        """Bytes of weight data one token routed here reads (as stored in the checkpoint)."""
        return sum(p.storage_bytes() for p in (self.gate, self.up, self.down))


def check_experts(layer: str, experts: Sequence[ExpertWeights], num_experts: int, hidden: int,
                  intermediate: int) -> None:
    """Every expert present with the shapes the config implies; typed errors naming layer and expert."""
    if len(experts) != num_experts:
        raise ConfigError(f"{layer}: the config says {num_experts} experts, the checkpoint provides "
                          f"{len(experts)}")
    want = {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden), "down_proj": (hidden, intermediate)}
    for e, ex in enumerate(experts):
        for proj, p in zip(PROJECTIONS, (ex.gate, ex.up, ex.down)):
            got = (p.out_features, p.in_features)
            if got != want[proj]:
                raise CheckpointError(f"{layer}: expert {e} {proj} is [{got[0]}, {got[1]}], the config "
                                      f"(hidden_size {hidden}, expert intermediate size {intermediate}) expects "
                                      f"[{want[proj][0]}, {want[proj][1]}]")


# ---- gate/up stacking --------------------------------------------------------

def stack_gate_up(gate: Proj, up: Proj, name: str) -> Proj | None:
    """``[gate; up]`` as one weight [2I, H], or None when the two cannot share one layout exactly."""
    if isinstance(gate, DenseWeight) and isinstance(up, DenseWeight):
        dt = gate.weight.dtype if gate.weight.dtype == up.weight.dtype else torch.float32
        return DenseWeight(torch.cat([gate.weight.to(dt), up.weight.to(dt)]), _cat_bias(gate, up), name)
    if isinstance(gate, QuantizedWeight) and isinstance(up, QuantizedWeight) and _stackable(gate, up):
        return _stack_quantized(gate, up, name)
    return None


def _stackable(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    if (a.bits, a.group_size, a.in_features, a.num_groups) != (b.bits, b.group_size, b.in_features, b.num_groups):
        return False
    if a.activation != b.activation:  # e.g. two different static input scales
        return False
    if (a.g_idx is None) != (b.g_idx is None):
        return False
    return a.g_idx is None or torch.equal(a.g_idx, b.g_idx)


def _stack_quantized(a: QuantizedWeight, b: QuantizedWeight, name: str) -> QuantizedWeight:
    if (a.two_level or a.codebook is not None) and a.layout() == b.layout():  # K-quants, MXFP4: rows as stored
        return QuantizedWeight.concat_rows([a, b], name).validate()
    # otherwise two-level scales as exact float32 groups, codebook codes in their uniform form
    a, b = a.single_level().uniform(), b.single_level().uniform()
    bits = max(a.bits, b.bits)
    a, b = a.widened(bits), b.widened(bits)  # e.g. FP4's 5-bit uniform codes beside Q4_0
    zeros = offsets = None
    if a.zeros is not None or b.zeros is not None:  # a symmetric half gets its implicit zero spelt out
        zeros = torch.cat([_zeros(a), _zeros(b)])
    if a.offsets is not None or b.offsets is not None:  # a missing offset is +0
        offsets = _cat_float(_offsets(a), _offsets(b))
    return QuantizedWeight(
        codes=torch.cat([a.codes, b.codes]), bits=a.bits, group_size=a.group_size,
        scales=_cat_float(a.scales, b.scales), zeros=zeros, offsets=offsets, g_idx=a.g_idx, dtype=a.dtype,
        bias=_cat_bias(a, b), activation=a.activation, name=name,
    ).validate()


def _zeros(w: QuantizedWeight) -> torch.Tensor:
    if w.zeros is not None:
        return w.zeros
    return torch.full(tuple(w.scales.shape), 1 << (w.bits - 1), dtype=torch.int16)


def _offsets(w: QuantizedWeight) -> torch.Tensor:
    return w.offsets if w.offsets is not None else torch.zeros(tuple(w.scales.shape), dtype=w.scales.dtype)


def _cat_float(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Concatenate rows; differing 16-bit dtypes meet in float32 (an exact upcast of both)."""
    if a.dtype != b.dtype:
        a, b = a.float(), b.float()
    return torch.cat([a, b])


def _cat_bias(a: Proj, b: Proj) -> torch.Tensor | None:
    if a.bias is None and b.bias is None:
        return None
    ba = a.bias.float() if a.bias is not None else torch.zeros(a.out_features)
    bb = b.bias.float() if b.bias is not None else torch.zeros(b.out_features)
    return torch.cat([ba, bb])
