"""The fast path: tokens grouped by expert, each expert's projections through the best linear kernel.

``prepare`` stacks gate and up into one ``[2I, H]`` weight per expert where
that is exact (:func:`quill.moe.experts.stack_gate_up`) and builds every
projection through the linear-kernel selector, so each expert runs on the
best kernel for its shape and format, and every linear kernel quill gains
serves MoE too.

``apply``:

* float32 with every expert's stacked gate_up and down on native kernels (biases or
  not) and a SiLU or clamped-SwiGLU activation: one native call (``quill.native``
  ExpertGroup, csrc/moe.cpp: one parallel region instead of 2k calls per token and
  their glue), the work laid out as below;
  the native decode step (quill.layers.native_step) runs the same code.
* otherwise, one token (decode): only its k experts run, on the token itself;
  nothing else is touched, so only the selected experts' weights are read.
* several tokens (prefill, batched decode): the (token, slot) pairs are sorted
  by expert, each expert that received tokens runs once on all of them (its
  weights are read once per step, in one GEMM of exactly its token count, so
  no block size has to be tuned), and the weighted outputs are scattered back
  with one ``index_add_``.  Experts no token chose cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from quill import native
from quill.kernels.linear import native_op
from quill.moe.base import LinearFactory, MoEBackend
from quill.moe.config import GatedAct, MoELayerConfig, gated_activation, native_activation
from quill.moe.experts import ExpertWeights, stack_gate_up

Fn = Callable[[torch.Tensor], torch.Tensor]
_PARTS = ("gate_up", "gate", "up", "down")  # GroupedExpert's linears, as saved


@dataclass
class GroupedExpert:
    """One expert's run-time linears: ``gate_up`` stacked, or ``gate`` and ``up`` apart."""

    gate_up: Fn | None
    gate: Fn | None
    up: Fn | None
    down: Fn
    intermediate: int

    def __call__(self, x: torch.Tensor, act: GatedAct) -> torch.Tensor:  # [n, H] -> [n, H]
        if self.gate_up is not None:
            gu = self.gate_up(x)  # [n, 2I]
            g, u = gu[:, : self.intermediate], gu[:, self.intermediate:]
        else:
            g, u = self.gate(x), self.up(x)  # [n, I] each
        return self.down(act(g, u))


@dataclass
class GroupedState:
    experts: list[GroupedExpert]
    act: GatedAct  # act(gate, up)
    top_k: int
    group: object | None = None  # the native ExpertGroup over every expert (float32 calls), or None


def _native_op(fn: Fn | None):
    """The C++ linear behind a built linear (its bias is the group's to add), or None."""
    return None if fn is None else native_op(fn)


def native_group(experts: list[GroupedExpert], hidden_act: str) -> object | None:
    """An ExpertGroup over ``experts`` when every one has a stacked gate_up and a down on native kernels
    and the activation is one csrc/moe.cpp computes (SiLU, gelu-tanh, gpt-oss's clamped SwiGLU); else None (the
    per-expert path runs).  The linears' biases are the group's (gpt-oss's experts have them)."""
    ext = native.load()
    act = native_activation(hidden_act)
    if ext is None or act is None or not experts:
        return None
    ops = [(_native_op(ex.gate_up), _native_op(ex.down)) for ex in experts]
    if any(a is None or b is None for a, b in ops):
        return None
    group = ext.module.ExpertGroup(experts[0].down.out_features, experts[0].intermediate, *act)
    for (a, b), ex in zip(ops, experts):
        group.add_expert(a, b, getattr(ex.gate_up, "bias", None), getattr(ex.down, "bias", None))
    return group


class GroupedBackend(MoEBackend):
    name = "grouped"

    @classmethod
    def can_implement(cls, cfg: MoELayerConfig) -> str | None:
        return None  # every projection goes through a linear kernel, which the linear selector finds

    @classmethod
    def prepare(cls, experts: Sequence[ExpertWeights], cfg: MoELayerConfig,
                make_linear: LinearFactory) -> GroupedState:
        built = [cls._prepare_expert(ex, make_linear) for ex in experts]
        return GroupedState(built, gated_activation(cfg.hidden_act), cfg.top_k, native_group(built, cfg.hidden_act))

    @staticmethod
    def _prepare_expert(ex: ExpertWeights, make_linear: LinearFactory) -> GroupedExpert:
        name = ex.gate.name.rpartition(".")[0] + ".gate_up_proj"
        stacked = stack_gate_up(ex.gate, ex.up, name)
        down = make_linear(ex.down)
        if stacked is not None:
            return GroupedExpert(make_linear(stacked), None, None, down, ex.gate.out_features)
        return GroupedExpert(None, make_linear(ex.gate), make_linear(ex.up), down, ex.gate.out_features)

    @classmethod
    def export_state(cls, state: GroupedState, export_linear: Callable) -> tuple[dict, dict[str, torch.Tensor]] | None:
        experts, tensors = [], {}
        for e, ex in enumerate(state.experts):
            parts = {}
            for part in _PARTS:
                fn = getattr(ex, part)
                if fn is None:
                    continue
                saved = export_linear(fn)
                if saved is None:
                    return None
                parts[part] = saved[0]
                tensors.update({f"{e}.{part}.{k}": t for k, t in saved[1].items()})
            experts.append({"intermediate": ex.intermediate, **parts})
        return {"experts": experts, "top_k": state.top_k}, tensors

    @classmethod
    def restore_state(cls, facts: dict, tensors: dict[str, torch.Tensor], cfg: MoELayerConfig,
                      restore_linear: Callable) -> GroupedState:
        by_part: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            e, part, field = key.split(".", 2)
            by_part.setdefault(f"{e}.{part}", {})[field] = t
        experts = []
        for e, ex in enumerate(facts["experts"]):
            built = {part: restore_linear(ex[part], by_part.get(f"{e}.{part}", {})) if part in ex else None
                     for part in _PARTS}
            experts.append(GroupedExpert(**built, intermediate=ex["intermediate"]))
        return GroupedState(experts, gated_activation(cfg.hidden_act), facts["top_k"],
                            native_group(experts, cfg.hidden_act))

    @classmethod
    def apply(cls, state: GroupedState, x: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> torch.Tensor:
        if state.group is not None and x.dtype == torch.float32:
            return state.group.forward(x.contiguous(), topk_ids.long().contiguous(), topk_weights.float().contiguous())
        if x.shape[0] == 1:
            return cls._one_token(state, x, topk_ids, topk_weights)
        return cls._grouped(state, x, topk_ids, topk_weights)

    @staticmethod
    def _one_token(state: GroupedState, x: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> torch.Tensor:
        experts, act = state.experts, state.act
        y = None
        for e, w in zip(topk_ids[0].tolist(), topk_weights[0].tolist()):
            out = experts[e](x, act)  # [1, H]
            if y is None:
                y = out.float() * w
            else:
                y.add_(out, alpha=w)  # float32 accumulation, one op
        return y.to(x.dtype)

    @staticmethod
    def _grouped(state: GroupedState, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        T, k = topk_ids.shape
        flat = topk_ids.reshape(-1)  # [T*k]
        order = torch.argsort(flat, stable=True)  # slots sorted by expert
        counts = torch.bincount(flat, minlength=len(state.experts)).tolist()
        tok = order // k  # [T*k] token of each sorted slot
        xs = x[tok]  # [T*k, H]
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                outs.append(state.experts[e](xs[start:start + n], state.act))
                start += n
        ys = torch.cat(outs).float() * topk_weights.reshape(-1)[order].float()[:, None]  # [T*k, H]
        y = torch.zeros(T, x.shape[1], dtype=torch.float32)
        y.index_add_(0, tok, ys)
        return y.to(x.dtype)
