"""Projections of one input run as one kernel call: q/k/v, gate/up.

A decode step of a small model spends much of its time in the fixed cost of each
kernel call (dispatch, a thread fork/join, an output allocation), not in its weight
reads.  :func:`merged` groups linear slots that read the same input: each part keeps
its checkpoint name and loads as before, but the group builds one kernel over the
parts' weights stacked along the output dimension (repacked once), and the model
gets every part's output from one call.  Rows of a linear are computed independently
of the other rows, so the outputs are the bits the separate calls give.

Parts that cannot share a kernel (different bits, group sizes, formats, or one dense
and one quantized, as a GGUF K-quant mix may have) are built one by one and the group
calls them in turn.
"""

from __future__ import annotations

import torch

from quill.canonical import QuantizedWeight
from quill.kernels import build_dense_linear, build_quant_linear
from quill.layers.context import LoadContext
from quill.layers.slots import dense_info, quant_info


class MergedLinear:
    """``group(x) -> (part_0(x), part_1(x), ...)``; built when its last part has loaded.

    Not an ``nn.Module``: the parts stay the model's modules under their own names.
    """

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.sizes = [p.out_features for p in parts]
        self.impl = None  # the one kernel over every part, when they could share one
        self._offers: dict[int, tuple[str, object]] = {}  # part index -> (name, QuantizedWeight | (w, b))
        for i, p in enumerate(parts):
            p.group, p.group_index = self, i

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [..., in] -> per part [..., out_i]
        if self.impl is not None:
            return self.impl(x).split(self.sizes, dim=-1)
        return tuple(p(x) for p in self.parts)

    def view(self, index: int) -> "_PartView":
        """What part ``index`` runs when called alone: its rows of the merged kernel."""
        return _PartView(self, index)

    def offer(self, part, name: str, weight, ctx: LoadContext) -> None:
        """Part ``part`` has loaded ``weight`` (a QuantizedWeight, or a dense (weight, bias)); build when complete."""
        self._offers[part.group_index] = (name, weight)
        if len(self._offers) == len(self.parts):
            offers = [self._offers[i] for i in range(len(self.parts))]
            self._offers = {}
            self._build(offers, ctx)

    def _build(self, offers: list[tuple[str, object]], ctx: LoadContext) -> None:
        names = [n for n, _ in offers]
        weights = [w for _, w in offers]
        label = "+".join(n.rpartition(".")[2] for n in names)
        if all(isinstance(w, QuantizedWeight) for w in weights) and _stackable(weights):
            stacked = QuantizedWeight.concat_rows(weights, f"{names[0].rpartition('.')[0]}.{label}")
            self.impl = build_quant_linear(stacked, ctx.selector, ctx.activation, bias_dtype=ctx.dtype)
            for part, name, w in zip(self.parts, names, weights):
                info = quant_info(name, self.impl, "quantized", rows=w.out_features)
                part.set_built(self.view(part.group_index), info)
        elif all(isinstance(w, tuple) for w in weights) and len({w.dtype for w, _ in weights}) == 1 and (
                len({b is None for _, b in weights}) == 1):
            w = torch.cat([w for w, _ in weights])
            b = None if weights[0][1] is None else torch.cat([b for _, b in weights])
            self.impl = build_dense_linear(f"{names[0].rpartition('.')[0]}.{label}", w, b, ctx.dtype, ctx.selector)
            for part, name, (pw, _) in zip(self.parts, names, weights):
                part.set_built(self.view(part.group_index), dense_info(name, self.impl, rows=pw.shape[0]))
        else:
            for part, name, w in zip(self.parts, names, weights):
                part.build_alone(name, w, ctx)


class _PartView:
    """One part's rows of a merged kernel (what a direct call of the part runs)."""

    def __init__(self, group: MergedLinear, index: int):
        self.group, self.index = group, index

    @property
    def kernel_name(self) -> str:
        return self.group.impl.kernel_name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group(x)[self.index]


def merged(*parts) -> MergedLinear:
    """Group linear slots that read the same input so they run as one kernel call."""
    return MergedLinear(list(parts))


def _stackable(ws: list[QuantizedWeight]) -> bool:
    first = ws[0]
    for w in ws[1:]:
        if w.layout() != first.layout():  # bits, groups, dtypes, presence of every optional tensor
            return False
        if (w.g_idx is None) != (first.g_idx is None):
            return False
        if w.g_idx is not None and not torch.equal(w.g_idx, first.g_idx):
            return False
    return True

