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

GPTQModel (since 5.8, through defuser's split of any fused ``gate_up_proj`` into its two halves, whatever the
layout: transformers marks gpt-oss's ``is_concatenated=False``, defuser ignores it) writes gpt-oss's experts per
expert as ``experts.<e>.gate_proj`` = rows 0 .. I - 1 of the fused [2 * I, hidden] projection and ``up_proj`` =
rows I .. 2I - 1, so each holds gates and ups interleaved, not the gate and the up its name says.
:class:`ExpertHalves` takes them (the model aliases them to ``<block>.halves.<e>.<proj>`` for such checkpoints),
joins each expert's two halves back into the fused projection (exact: rows are independent) and cuts it into the
real gate (rows 0, 2, 4 ...) and up (rows 1, 3, 5 ...).
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
from quill.moe.experts import Proj, stack_gate_up

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


class _Half(nn.Module, Slot):
    """One of an expert's two stored halves of its fused gate_up projection ([I, hidden], a bias if the experts
    have one), handed to its :class:`ExpertHalves` as soon as it is whole."""

    def __init__(self, owner: "ExpertHalves", expert: int, part: int):
        super().__init__()
        self.expert, self.part = expert, part
        self.owner = [owner]  # a list, so the owner is not registered as a submodule of its own child
        self._pending: dict[str, torch.Tensor] = {}

    @property
    def filled(self) -> bool:
        return True  # a half that never arrives leaves its expert's gate and up empty: the MoE block says which

    def check_filled(self, name: str, ctx: LoadContext) -> None:
        """Missing halves are reported by the MoE block (post_load), as the expert projections they fill."""

    def load_tensor(self, name: str, attr: str, tensor: torch.Tensor, ctx: LoadContext) -> bool:
        if attr not in ("weight", "bias"):
            return False
        self._pending[attr] = tensor
        return True

    def load_quantized(self, name: str, weight: QuantizedWeight, ctx: LoadContext) -> bool:
        if weight.bias is None and "bias" in self._pending:  # a bias stored beside, not inside, the weight
            weight = weight.with_(bias=self._pending["bias"])
        self._pending = {}
        self.owner[0].offer(self.expert, self.part, weight, ctx)
        return True

    def finish(self, name: str, ctx: LoadContext) -> bool:
        parts, self._pending = self._pending, {}
        if "weight" not in parts:
            return False
        self.owner[0].offer(self.expert, self.part, DenseWeight(parts["weight"], parts.get("bias")), ctx)
        return True

    def save(self, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
        return {}, {}  # what it filled lives in (and is saved by) the MoE block

    def restore(self, name: str, facts: dict, tensors: dict[str, torch.Tensor], ctx: LoadContext) -> None:
        pass


class ExpertHalves(nn.Module):
    """``<block>.halves``: per expert ``<e>.gate_proj`` and ``<e>.up_proj`` holding the first and second half of the
    rows of its fused gate_up projection, gates and ups interleaved (GPTQModel's gpt-oss; module docstring).  When
    both halves of an expert are in, it joins them and delivers rows 0, 2, 4 ... as the gate, 1, 3, 5 ... as the up."""

    def __init__(self, experts: int, hidden: int, intermediate: int, deliver: Deliver, name: str):
        super().__init__()
        self.hidden, self.intermediate, self.deliver, self.name = hidden, intermediate, deliver, name
        for e in range(experts):  # slots <block>.halves.<e>.gate_proj / .up_proj
            self.add_module(str(e), nn.ModuleDict({"gate_proj": _Half(self, e, 0), "up_proj": _Half(self, e, 1)}))
        self._offers: dict[int, dict[int, Proj]] = {}

    def offer(self, expert: int, part: int, weight: Proj, ctx: LoadContext) -> None:
        """Half ``part`` (0: rows 0 .. I - 1, 1: the rest) of expert ``expert``'s fused gate_up projection."""
        names = [f"{self.name}.experts.{expert}.{p}" for p in ("gate_proj", "up_proj")]  # as the checkpoint names them
        if (weight.out_features, weight.in_features) != (self.intermediate, self.hidden):
            raise CheckpointError(f"{ctx.where}: expert projection '{names[part]}' is [{weight.out_features}, "
                                  f"{weight.in_features}], the model expects [{self.intermediate}, {self.hidden}] "
                                  "(half of the expert's fused gate_up projection)")
        offers = self._offers.setdefault(expert, {})
        if part in offers:
            raise CheckpointError(f"{ctx.where}: expert projection '{names[part]}' is provided twice by the checkpoint")
        offers[part] = weight
        if len(offers) < 2:
            return
        del self._offers[expert]
        fused = stack_gate_up(offers[0], offers[1], f"{self.name}.experts.{expert}.gate_up_proj")
        if fused is None:
            kinds = ["quantized" if isinstance(w, QuantizedWeight) else "dense" for w in (offers[0], offers[1])]
            raise CheckpointError(
                f"{ctx.where}: '{names[0]}' ({kinds[0]}) and '{names[1]}' ({kinds[1]}) are the two halves of expert "
                f"{expert}'s fused gate_up projection (GPTQModel's gpt-oss layout: the gate and up rows interleaved "
                "across both) and cannot be joined exactly (one dense and one quantized, or quantized with different "
                "bits, groups or act-order g_idx); such a checkpoint is not supported")
        for part, name in ((0, "gate_proj"), (1, "up_proj")):
            ids = torch.arange(part, 2 * self.intermediate, 2)
            rows = (fused.take_rows(ids) if isinstance(fused, QuantizedWeight)
                    else DenseWeight(fused.weight.index_select(0, ids),
                                     None if fused.bias is None else fused.bias.index_select(0, ids)))
            self.deliver(expert, name, rows, ctx)


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
