"""The oracle: dequantize to float32 once, then a float32 matmul.

Always available and always correct by construction (it is the canonical
formula plus torch.matmul); every other kernel is tested against it.  For int8
activations it quantizes the input exactly as the int8 kernels do, so the
only remaining difference is float rounding in the accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quill.canonical import ActivationQuant, QuantizedWeight
from quill.kernels.activation import fake_quantize_activations
from quill.kernels.base import LinearKernel
from quill.kernels.config import LinearLayerConfig


@dataclass
class ReferenceState:
    weight: torch.Tensor  # float32 [out, in], act-order already resolved by the dequantization
    activation: ActivationQuant | None
    groups: torch.Tensor | None = None  # int64 [in], each column's weight group (per-group int8 activations)


class ReferenceKernel(LinearKernel):
    name = "reference"

    @classmethod
    def can_implement(cls, cfg: LinearLayerConfig) -> str | None:
        return None

    @classmethod
    def prepare(cls, weight: QuantizedWeight, cfg: LinearLayerConfig) -> ReferenceState:
        act = weight.activation
        return ReferenceState(weight.dequantize().contiguous(), act,
                              weight.activation_groups() if act is not None and act.per_group else None)

    @classmethod
    def apply(cls, state: ReferenceState, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k).float()  # [M, K]
        if state.activation is not None:
            x2 = fake_quantize_activations(x2, state.activation, state.groups)
        y = x2 @ state.weight.T  # [M, N]
        if bias is not None:
            y = y + bias.float()
        return y.reshape(*lead, y.shape[-1]).to(x.dtype)  # -1 is ambiguous for 0 rows
