"""The oracle: a per-expert loop of ``reference`` linears (float32 dequantized weights).

Gate and up stay separate (no stacking), every expert computes in float32,
and the routed outputs are combined in float32, exactly as the definition
reads.  Every other backend is tested against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quill.kernels.config import LinearLayerConfig
from quill.kernels.reference import ReferenceKernel, ReferenceState
from quill.moe.base import LinearFactory, MoEBackend
from quill.moe.config import GatedAct, MoELayerConfig, gated_activation
from quill.moe.experts import DenseWeight, ExpertWeights, Proj


@dataclass
class _RefLinear:
    state: ReferenceState
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] float32 -> [n, out] float32
        return ReferenceKernel.apply(self.state, x, self.bias)


@dataclass
class ReferenceMoEState:
    experts: list[tuple[_RefLinear, _RefLinear, _RefLinear]]  # (gate, up, down) per expert
    act: GatedAct  # act(gate, up)


def _ref_linear(p: Proj, cfg: MoELayerConfig) -> _RefLinear:
    if isinstance(p, DenseWeight):
        state = ReferenceState(p.weight.float().contiguous(), None)
    else:
        state = ReferenceKernel.prepare(p, LinearLayerConfig.from_weight(p, cfg.platform))
    return _RefLinear(state, None if p.bias is None else p.bias.float())


class ReferenceBackend(MoEBackend):
    name = "reference"

    @classmethod
    def can_implement(cls, cfg: MoELayerConfig) -> str | None:
        return None

    @classmethod
    def prepare(cls, experts: Sequence[ExpertWeights], cfg: MoELayerConfig,
                make_linear: LinearFactory | None = None) -> ReferenceMoEState:
        return ReferenceMoEState([tuple(_ref_linear(p, cfg) for p in (ex.gate, ex.up, ex.down))
                                  for ex in experts], gated_activation(cfg.hidden_act))

    @classmethod
    def apply(cls, state: ReferenceMoEState, x: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # [T, H]
        y = torch.zeros_like(xf)
        for e, (gate, up, down) in enumerate(state.experts):
            tok, slot = torch.where(topk_ids == e)  # tokens routed to e, and in which of their k slots
            if tok.numel() == 0:
                continue
            h = xf[tok]  # [n, H]
            out = down(state.act(gate(h), up(h)))  # [n, H]
            y.index_add_(0, tok, out * topk_weights[tok, slot].float()[:, None])
        return y.to(x.dtype)
