"""Experts a checkpoint stores stacked, one tensor per projection for the whole layer, split into the
per-expert slots of a :class:`quill.layers.moe.SparseMoeBlock`; and a plain per-head vector slot.

gpt-oss checkpoints (transformers' ``GptOssExperts``) hold, per MoE layer::

    experts.gate_up_proj       [E, hidden, 2 * I]   x @ W layout; gate and up interleaved along 2 * I
    experts.gate_up_proj_bias  [E, 2 * I]           (gate = columns 0, 2, 4 ..., up = 1, 3, 5 ...)
    experts.down_proj          [E, I, hidden]
    experts.down_proj_bias     [E, hidden]

Gemma 4's (transformers' ``Gemma4TextExperts``) are ``nn.functional.linear`` weights, gate and up in halves::

    experts.gate_up_proj       [E, 2 * I, hidden]   rows: gate 0 .. I - 1, up I .. 2I - 1
    experts.down_proj          [E, hidden, I]

(``halves=True``), or, quantized, one canonical weight per projection whose rows are the E experts' output rows stacked
(``[E * out, in]``, the bias likewise).  Either way expert e's projection is rows ``e * out ...`` of the
``[E * out, in]`` form; this slot cuts them out (``take_rows``, exact) and fills the block's expert slots,
which then build the layer as for any per-expert checkpoint.  The model aliases the stacked names onto
``<block>.stacked.<proj>`` (see ``quill.models.gpt_oss``), so a dense ``<block>.stacked.gate_up_proj``
arrives here and a quantized layer of that name at the child slot.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from quill.canonical import QuantizedWeight
from quill.errors import CheckpointError
from quill.layers.context import LoadContext
from quill.layers.slots import Slot, checked
from quill.moe import DenseWeight

Deliver = Callable[[int, str, object, LoadContext], None]  # (expert, projection, weight, ctx)


def checkpoint_name(name: str, suffix: str = "") -> str:
    """``<block>.stacked.<proj>`` as the checkpoint spells it, ``<block>.experts.<proj><suffix>``: what errors name."""
    return name.replace(".stacked.", ".experts.") + suffix


class StackedProj(nn.Module, Slot):
    """One stacked projection: ``experts`` x ``out`` rows of ``in_features``, then split per expert."""

    def __init__(self, experts: int, out_features: int, in_features: int, parts: tuple[str, ...],
                 halves: bool = False):
        super().__init__()
        self.experts, self.out_features, self.in_features = experts, out_features, in_features
        self.parts = parts  # the per-expert projections it holds, interleaved by row (gate, up) or one (down)
        self.halves = halves  # Gemma 4: dense [E, out, in], the parts in consecutive halves of the rows
        self.weight: torch.Tensor | None = None  # dense [E, in, out] as stored (x @ W)
        self.bias: torch.Tensor | None = None  # dense [E, out]
        self.deliver: Deliver | None = None  # set by the block that owns the expert slots
        self.done = False

    @property
    def filled(self) -> bool:
        return self.done

    def check_filled(self, name: str, ctx: LoadContext) -> None:
        """Missing experts are reported by the MoE block (post_load), per expert projection."""

    def load_tensor(self, name: str, attr: str, tensor: torch.Tensor, ctx: LoadContext) -> bool:
        if attr != "bias":
            return False
        self.bias = checked(ctx, checkpoint_name(name, "_bias"), tensor, (self.experts, self.out_features))
        return True

    def take_dense(self, name: str, tensor: torch.Tensor, ctx: LoadContext) -> None:
        if self.halves:  # stored [E, out, in]: held as gpt-oss's [E, in, out] view (no copy)
            tensor = checked(ctx, name, tensor, (self.experts, self.out_features, self.in_features)).transpose(1, 2)
        self.weight = checked(ctx, name, tensor, (self.experts, self.in_features, self.out_features))

    def load_quantized(self, name: str, weight: QuantizedWeight, ctx: LoadContext) -> bool:
        rows = self.experts * self.out_features
        if (weight.out_features, weight.in_features) != (rows, self.in_features):
            raise CheckpointError(f"{ctx.where}: quantized layer '{checkpoint_name(name)}' is [{weight.out_features}, "
                                  f"{weight.in_features}], the model expects {self.experts} experts' "
                                  f"[{self.out_features}, {self.in_features}] stacked: [{rows}, {self.in_features}]")
        if weight.bias is None and self.bias is not None:  # a bias stored beside, not inside, the weight
            weight = weight.with_(bias=self.bias.reshape(rows))
        self._split(name, lambda e, ids: weight.take_rows(e * self.out_features + ids), ctx)
        return True

    def finish(self, name: str, ctx: LoadContext) -> bool:
        if self.done or self.weight is None:
            return False
        w, b = self.weight.transpose(1, 2), self.bias  # [E, out, in]: rows are output features

        def rows(e: int, ids: torch.Tensor) -> DenseWeight:
            return DenseWeight(w[e].index_select(0, ids).contiguous(),
                               None if b is None else b[e].index_select(0, ids))
        self.weight = None
        self._split(name, rows, ctx)
        return True

    def save(self, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
        """Nothing: the experts it filled live in (and are saved by) their MoE block."""
        return {}, {}

    def restore(self, name: str, facts: dict, tensors: dict[str, torch.Tensor], ctx: LoadContext) -> None:
        self.done = True

    def _split(self, name: str, rows: Callable[[int, torch.Tensor], object], ctx: LoadContext) -> None:
        if self.deliver is None:
            raise CheckpointError(f"{ctx.where}: '{checkpoint_name(name)}' has no MoE block to fill")
        if self.done:
            raise CheckpointError(f"{ctx.where}: stacked experts '{checkpoint_name(name)}' are provided twice by the "
                                  "checkpoint")
        n = len(self.parts)
        for e in range(self.experts):
            for i, part in enumerate(self.parts):
                # interleaved rows: part i of expert e is rows i, i + n, i + 2n ... of its block; or its i-th share
                ids = (torch.arange(i * self.out_features // n, (i + 1) * self.out_features // n) if self.halves
                       else torch.arange(i, self.out_features, n))
                self.deliver(e, part, rows(e, ids), ctx)
        self.done = True


class StackedExperts(nn.Module, Slot):
    """``<block>.stacked``: the dense stacked tensors arrive here (``gate_up_proj``, ``down_proj``), their
    biases and quantized forms at the children of the same names."""

    def __init__(self, experts: int, hidden: int, intermediate: int, deliver: Deliver, halves: bool = False):
        super().__init__()
        self.gate_up_proj = StackedProj(experts, 2 * intermediate, hidden, ("gate_proj", "up_proj"), halves)
        self.down_proj = StackedProj(experts, hidden, intermediate, ("down_proj",), halves)
        self.gate_up_proj.deliver = self.down_proj.deliver = deliver

    @property
    def filled(self) -> bool:
        return True

    def load_tensor(self, name: str, attr: str, tensor: torch.Tensor, ctx: LoadContext) -> bool:
        child = {"gate_up_proj": self.gate_up_proj, "down_proj": self.down_proj}.get(attr)
        if child is None:
            return False
        child.take_dense(checkpoint_name(f"{name}.{attr}"), tensor, ctx)
        return True

    def save(self, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
        return {}, {}  # a router of tensors only; its children and the block hold the rest

    def restore(self, name: str, facts: dict, tensors: dict[str, torch.Tensor], ctx: LoadContext) -> None:
        pass

    def finish(self, name: str, ctx: LoadContext) -> bool:
        built = self.gate_up_proj.finish(f"{name}.gate_up_proj", ctx)
        return self.down_proj.finish(f"{name}.down_proj", ctx) or built


class Vector(nn.Module, Slot):
    """A learned vector the layer reads as is (gpt-oss's attention sinks, one per query head), kept in float32."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size
        self.weight: torch.Tensor | None = None

    @property
    def filled(self) -> bool:
        return self.weight is not None

    def load_tensor(self, name: str, attr: str, tensor: torch.Tensor, ctx: LoadContext) -> bool:
        if attr != "weight":
            return False
        self.weight = checked(ctx, f"{name}.weight", tensor.reshape(-1) if tensor.dim() == 2 else tensor,
                              (self.size,)).float()
        return True

    def save(self, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
        return {}, {"weight": self.weight}

    def restore(self, name: str, facts: dict, tensors: dict[str, torch.Tensor], ctx: LoadContext) -> None:
        self.weight = checked(ctx, f"{name}.weight", tensors["weight"], (self.size,))
