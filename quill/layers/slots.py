"""Slots: the modules model files build and the loader fills by name.

Model files build their linear layers with :func:`linear` and their embedding
with :class:`Embedding`.  Both are *slots*: empty at construction, filled once
at load time with whatever the checkpoint holds for that module name: a
canonical ``QuantizedWeight`` (run through a kernel chosen by ``quill.kernels``)
or a dense float tensor.  Model code never learns which, and the loader only
routes names: each slot checks and builds what it receives (``load_tensor``,
``load_quantized``, ``finish``), the way nano-vllm's parameters carry their own
weight loaders.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from quill.canonical import QuantizedWeight
from quill.errors import CacheError, CheckpointError, NotCacheable
from quill.kernels import DenseLinear, build_dense_linear, build_quant_linear, export_linear, fused, restore_linear
from quill.layers.context import LayerInfo, LoadContext


class Saved:
    """A module whose built state the prepacked cache saves and restores (quill.layers.snapshot)."""

    def save(self, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
        """What this module built, as JSON-able facts and tensors; NotCacheable when it cannot be saved."""
        raise NotCacheable(f"{name}: {type(self).__name__} layers are not saved in the prepacked cache")

    def restore(self, name: str, facts: dict, tensors: dict[str, torch.Tensor], ctx: LoadContext) -> None:
        """Become what :meth:`save` described, around ``tensors`` as they are."""
        raise CacheError(f"{name}: {type(self).__name__} layers cannot be restored from the prepacked cache")


class Slot(Saved):
    """A module filled from the checkpoint by name (mixed into an ``nn.Module``)."""

    def load_tensor(self, name: str, attr: str, tensor: torch.Tensor, ctx: LoadContext) -> bool:
        """Take dense tensor ``<name>.<attr>``; False when this slot has no place for it."""
        return False

    def load_quantized(self, name: str, weight: QuantizedWeight, ctx: LoadContext) -> bool:
        """Take the quantized layer ``name``; False when this slot has no place for one."""
        return False

    def finish(self, name: str, ctx: LoadContext) -> bool:
        """Build what the dense tensors delivered; True when a layer was built."""
        return False

    @property
    def filled(self) -> bool:
        raise NotImplementedError

    def check_filled(self, name: str, ctx: LoadContext) -> None:
        if not self.filled:
            raise CheckpointError(f"{ctx.where}: the checkpoint has no tensor for '{name}' (expected '{name}.weight')")

    def info(self, name: str) -> LayerInfo | None:
        """What ``quill inspect`` shows about this slot, or None for slots it does not list."""
        return None



def saved_info(info: LayerInfo | None) -> dict | None:
    return None if info is None else dataclasses.asdict(info)


def restored_info(facts: dict | None) -> LayerInfo | None:
    if facts is None:
        return None
    return LayerInfo(**{**facts, "refusals": tuple(tuple(r) for r in facts["refusals"])})


def checked(ctx: LoadContext, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` if it is a float tensor of ``shape``, else a CheckpointError naming tensor and checkpoint."""
    if not t.is_floating_point():
        raise CheckpointError(f"{ctx.where}: tensor '{name}' has dtype {t.dtype}, expected a float dtype")
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{ctx.where}: tensor '{name}' has shape {list(t.shape)}, "
                              f"the model expects {list(shape)}")
    return t


def check_qshape(ctx: LoadContext, name: str, qw: QuantizedWeight, out: int, inp: int) -> None:
    if (qw.out_features, qw.in_features) != (out, inp):
        raise CheckpointError(f"{ctx.where}: quantized layer '{name}' is [{qw.out_features}, "
                              f"{qw.in_features}], the model expects [{out}, {inp}]")


def checked_bias(ctx: LoadContext, name: str, has_bias: bool, out: int,
                 bias: torch.Tensor | None) -> torch.Tensor | None:
    """The layer's bias (from the quantized weight or the dense ``<name>.bias``), checked against the architecture."""
    if bias is not None and not has_bias:
        raise CheckpointError(f"{ctx.where}: layer '{name}' has a bias in the checkpoint, but this "
                              "architecture has none there")
    if bias is None and has_bias:
        raise CheckpointError(f"{ctx.where}: layer '{name}': tensor '{name}.bias' is missing")
    if bias is not None:
        checked(ctx, f"{name}.bias", bias, (out,))
    return bias


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Linear(nn.Module, Slot):
    """A linear slot ``y = x @ W^T (+ b)``; ``impl`` is set at load (QuantLinear or DenseLinear)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bias
        self.impl: Any = None
        self._pending: dict[str, torch.Tensor] = {}  # dense weight / bias until finish
        self._info: LayerInfo | None = None
        self.group = None  # a quill.layers.merged.MergedLinear that builds this part with its siblings
        self.group_index = 0
        self._offered = False  # handed its weight to the group (built when the last part arrives)

    @property
    def filled(self) -> bool:
        return self.impl is not None or self._offered

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self.impl(x)

    def extra_repr(self) -> str:
        kind = "empty" if self.impl is None else self.impl.kernel_name
        return f"{self.in_features} -> {self.out_features}, bias={self.has_bias}, {kind}"

    def load_tensor(self, name: str, attr: str, tensor: torch.Tensor, ctx: LoadContext) -> bool:
        if attr not in ("weight", "bias"):
            return False
        self._pending[attr] = tensor
        return True

    def load_quantized(self, name: str, weight: QuantizedWeight, ctx: LoadContext) -> bool:
        check_qshape(ctx, name, weight, self.out_features, self.in_features)
        bias = weight.bias if weight.bias is not None else self._pending.get("bias")
        bias = checked_bias(ctx, name, self.has_bias, self.out_features, bias)
        self._pending = {}
        weight = weight.with_(bias=bias, name=name)
        if self.group is not None:
            self._offered = True
            self.group.offer(self, name, weight, ctx)
        else:
            self.build_alone(name, weight, ctx)
        return True

    def build_alone(self, name: str, weight, ctx: LoadContext) -> None:
        """Build this layer's own kernel from a QuantizedWeight or a dense (weight, bias)."""
        if isinstance(weight, QuantizedWeight):
            self.impl = build_quant_linear(weight, ctx.selector, ctx.activation, bias_dtype=ctx.dtype)
            self._info = quant_info(name, self.impl, "quantized")
        else:
            self.impl = build_dense_linear(name, weight[0], weight[1], ctx.dtype, ctx.selector)
            self._info = dense_info(name, self.impl)

    def set_built(self, impl, info: LayerInfo) -> None:
        """Called by this part's group once it has built the shared kernel."""
        self.impl, self._info = impl, info

    def finish(self, name: str, ctx: LoadContext) -> bool:
        parts, self._pending = self._pending, {}
        if self.impl is not None or "weight" not in parts:
            return False  # loaded quantized, or reported as missing by check_filled
        w = checked(ctx, f"{name}.weight", parts["weight"], (self.out_features, self.in_features))
        bias = checked_bias(ctx, name, self.has_bias, self.out_features, parts.get("bias"))
        if self.group is not None:
            self._offered = True
            self.group.offer(self, name, (w, bias), ctx)
        else:
            self.build_alone(name, (w, bias), ctx)
        return True

    def tie(self, embedding: "Embedding", ctx: LoadContext) -> None:
        """lm_head sharing the embedding's table (dense, or quantized through a kernel)."""
        if embedding.weight is not None:
            self.impl = build_dense_linear("lm_head", embedding.weight, None, ctx.dtype, ctx.selector)
            self.impl.weight_bytes = 0  # shares the embedding's storage
            self._info = dense_info("lm_head", self.impl, "tied")
        elif embedding.quantized is not None:
            self.impl = build_quant_linear(embedding.quantized.with_(name="lm_head", bias=None), ctx.selector,
                                           ctx.activation, bias_dtype=ctx.dtype)
            self._info = quant_info("lm_head", self.impl, "tied")

    def check_filled(self, name: str, ctx: LoadContext) -> None:
        if not self.filled:
            raise CheckpointError(f"{ctx.where}: the checkpoint has no quantized layer or tensor for '{name}' "
                                  f"(expected '{name}.weight')")

    @property
    def tied_to_table(self) -> bool:
        """An lm_head running the embedding's own float table (shares its storage: rebuilt by tying)."""
        return (self._info is not None and self._info.kind == "tied" and isinstance(self.impl, DenseLinear)
                and self.impl.native is None)

    def save(self, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
        facts: dict = {"info": saved_info(self._info)}
        if self.tied_to_table:
            return {**facts, "tied": True}, {}
        if self.group is not None and self.group.impl is not None:  # one part of a merged kernel
            facts["part"] = self.group_index
            if self.group_index:
                return facts, {}
            impl = self.group.impl  # saved once, with the first part
        else:
            impl = self.impl
        saved = export_linear(impl)
        if saved is None:
            raise NotCacheable(f"{name}: kernel {impl.kernel_name} does not save its state")
        facts["impl"], tensors = saved
        return facts, tensors

    def restore(self, name: str, facts: dict, tensors: dict[str, torch.Tensor], ctx: LoadContext) -> None:
        info = restored_info(facts["info"])
        if facts.get("tied"):
            return  # tied by the caller once the embedding is back
        impl = restore_linear(facts["impl"], tensors, ctx.selector, ctx.dtype) if "impl" in facts else None
        if "part" not in facts:
            self.impl, self._info = impl, info
            return
        if self.group is None or facts["part"] != self.group_index:
            raise CacheError(f"{name}: saved as part {facts['part']} of a merged kernel, which this model "
                             "does not build")
        if impl is not None:
            self.group.impl = impl
        self._offered = True
        self.set_built(self.group.view(self.group_index), info)

    def info(self, name: str) -> LayerInfo | None:
        return self._info


def quant_info(name: str, ql, kind: str, rows: int | None = None) -> LayerInfo:
    """``quill inspect``'s row for quantized layer ``name`` run by ``ql``; ``rows``: its share of a merged kernel."""
    c = ql.config
    summary, n = c.summary(), c.out_features if rows is None else rows
    if rows is not None:
        summary += f" (merged: {rows} of {c.out_features} rows)"
    nbytes = 0 if kind == "tied" else ql.weight_bytes * n // c.out_features
    held = ql.selection.kernel.state_bytes(ql.state) * n // c.out_features
    return LayerInfo(name, kind, summary, c.bits, c.group_size, c.symmetric, ql.kernel_name,
                     ql.selection.refusals, nbytes, c.in_features * n, held)


def dense_info(name: str, dl, kind: str = "dense", rows: int | None = None) -> LayerInfo:
    """``quill inspect``'s row for dense layer ``name`` run by ``dl``; ``rows``: its share of a merged kernel."""
    n = dl.out_features if rows is None else rows
    summary = f"dense {dtype_name(dl.dtype)} {n}x{dl.in_features}"
    if rows is not None:
        summary += f" (merged: {rows} of {dl.out_features} rows)"
    held = dl.in_features * n * (2 if dl.native is not None else dl.weight.element_size())
    return LayerInfo(name, kind, summary, None, None, None, dl.kernel_name, (), dl.weight_bytes * n // dl.out_features,
                     dl.in_features * n, held)


class PostLoad:
    """Mixin for modules that finish their own set-up once every slot is filled.

    The hook for blocks that regroup loaded layers, e.g. a mixture-of-experts
    block stacking its per-expert linears (``mlp.experts.<e>.gate_proj``, ...).
    """

    def post_load(self) -> None:
        raise NotImplementedError


def linear(in_features: int, out_features: int, bias: bool = False) -> Linear:
    """The layer factory every model uses for its projections."""
    return Linear(in_features, out_features, bias)


def take_rows(weight: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """float32 [len(ids), in]: dequantize only the rows ``ids`` of a quantized matrix (embedding lookup)."""
    return weight.dequantize_rows(ids)


class Embedding(nn.Module, Slot):
    """Token embedding slot: a dense [vocab, dim] table or a quantized one (GGUF ``token_embd``).

    A quantized table is kept in canonical form and only the looked-up rows are
    dequantized, so it costs its quantized size, not a float copy.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight: torch.Tensor | None = None  # dense, as the checkpoint stores it (a memory map, not a copy)
        self.quantized: QuantizedWeight | None = None
        self._info: LayerInfo | None = None

    @property
    def filled(self) -> bool:
        return self.weight is not None or self.quantized is not None

    @property
    def table_dtype(self) -> torch.dtype:
        """The dtype rows come out of the table in: the stored one, float32 for a quantized table."""
        return self.weight.dtype if self.weight is not None else torch.float32

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [B, T] -> [B, T, D]
        if self.weight is not None:
            return self.weight[ids].to(dtype)
        flat = take_rows(self.quantized, ids.reshape(-1))
        return flat.reshape(*ids.shape, self.embedding_dim).to(dtype)

    def load_tensor(self, name: str, attr: str, tensor: torch.Tensor, ctx: LoadContext) -> bool:
        if attr != "weight":
            return False
        shape = (self.num_embeddings, self.embedding_dim)
        self.weight = checked(ctx, f"{name}.weight", tensor, shape)  # as stored: rows convert on lookup
        self._info = LayerInfo(name, "embedding", f"dense {dtype_name(self.weight.dtype)} {shape[0]}x{shape[1]}",
                               None, None, None, "lookup", (), tensor.numel() * tensor.element_size(), tensor.numel())
        return True

    def save(self, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
        if self.weight is not None:
            return {"info": saved_info(self._info)}, {"weight": self.weight}
        facts, tensors = self.quantized.saved()
        return {"info": saved_info(self._info), "quantized": facts}, tensors

    def restore(self, name: str, facts: dict, tensors: dict[str, torch.Tensor], ctx: LoadContext) -> None:
        self._info = restored_info(facts["info"])
        if "quantized" in facts:
            self.quantized = QuantizedWeight.from_saved(facts["quantized"], tensors)
            check_qshape(ctx, name, self.quantized, self.num_embeddings, self.embedding_dim)
        else:
            self.weight = checked(ctx, f"{name}.weight", tensors["weight"], (self.num_embeddings, self.embedding_dim))

    def load_quantized(self, name: str, weight: QuantizedWeight, ctx: LoadContext) -> bool:
        check_qshape(ctx, name, weight, self.num_embeddings, self.embedding_dim)
        self.quantized = weight
        g = "ch" if weight.per_channel else f"g{weight.group_size}"
        self._info = LayerInfo(
            name, "embedding", f"W{weight.bits} {g} {'sym' if weight.symmetric else 'asym'} rows dequantized on lookup",
            weight.bits, weight.group_size, weight.symmetric, "lookup", (), weight.storage_bytes(),
            weight.codes.numel())
        return True

    def info(self, name: str) -> LayerInfo | None:
        return self._info


class RMSNorm(nn.Module, Slot):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 as transformers does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight: torch.Tensor | None = None  # [dim], compute dtype

    @property
    def filled(self) -> bool:
        return self.weight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def load_tensor(self, name: str, attr: str, tensor: torch.Tensor, ctx: LoadContext) -> bool:
        if attr != "weight":
            return False
        self.weight = checked(ctx, f"{name}.weight", tensor, (self.dim,)).to(ctx.dtype)
        return True

    def save(self, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
        return {}, {"weight": self.weight}

    def restore(self, name: str, facts: dict, tensors: dict[str, torch.Tensor], ctx: LoadContext) -> None:
        self.weight = checked(ctx, f"{name}.weight", tensors["weight"], (self.dim,))
