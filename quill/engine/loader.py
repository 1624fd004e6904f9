"""Load a checkpoint into a model: resolve the path, build the architecture, fill every slot.

    loaded = load_model("path/to/checkpoint", selector)
    logits = loaded.model(tokens, ctx)

Dense tensors (norms, embeddings, layers the checkpoint left unquantized) are
memory-mapped and read first; quantized layers are then streamed one at a time,
each repacked by its kernel as it arrives, so only one layer is ever unpacked.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from quill.errors import CheckpointError
from quill.kernels import KernelSelector, build_dense_linear, build_quant_linear
from quill.engine.memory import LoadMemory, MemoryMeter, release_freed_memory
from quill.models import model_module
from quill.models.layers import Embedding, Linear, PostLoad, RMSNorm
from quill.models.moe_block import ExpertSlot, LoadContext
from quill.moe import DenseWeight, MoESelector
from quill.quantization.checkpoint import open_checkpoint
from quill.canonical import QuantizedWeight

# Tensors some checkpoints carry that the model recomputes (older HF exports store rotary tables).
IGNORED_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class LayerInfo:
    """How one weight matrix (a linear layer or the embedding) was loaded, for ``quill inspect``."""

    name: str
    # "quantized", "dense", "tied" (lm_head sharing the embedding), "embedding" or "expert" (an MoE expert projection)
    kind: str
    summary: str  # e.g. "W4A16 g128 sym 256x128"
    bits: int | None
    group_size: int | None
    symmetric: bool | None
    kernel: str
    refusals: tuple[tuple[str, str], ...]  # kernels ranked higher that refused, with their reasons
    weight_bytes: int  # as stored in the checkpoint
    num_weights: int


@dataclass
class LoadedModel:
    """A model ready to run, with what was learned while loading it."""

    model: nn.Module
    checkpoint: Any
    path: Path
    layers: list[LayerInfo]
    memory: LoadMemory
    dtype: torch.dtype
    extra: dict = field(default_factory=dict)

    @property
    def weight_bytes(self) -> int:
        return sum(i.weight_bytes for i in self.layers if i.kind != "tied")

    @property
    def num_weights(self) -> int:
        return sum(i.num_weights for i in self.layers if i.kind != "tied")


class _SlotFiller:
    """Routes each checkpoint tensor or quantized layer to the model slot of the same name."""

    def __init__(self, model: nn.Module, ctx: LoadContext, where: str, progress: tqdm):
        self.model, self.ctx = model, ctx
        self.selector, self.activation, self.dtype = ctx.selector, ctx.activation, ctx.dtype
        self.where, self.progress = where, progress
        self.modules = dict(model.named_modules())
        # checkpoint spellings the architecture also accepts (e.g. Mixtral experts' gate_proj for w1)
        self.aliases = [(re.compile(pattern), repl) for pattern, repl in model.checkpoint_aliases]
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # dense linear parts by module
        self.unexpected: list[str] = []
        self.infos: dict[str, LayerInfo] = {}

    # ---- dense tensors -----------------------------------------------------
    def _canonical(self, name: str) -> str:
        for pattern, repl in self.aliases:
            name = pattern.sub(repl, name)
        return name

    def dense(self, name: str, tensor: torch.Tensor) -> None:
        name = self._canonical(name)
        module_name, _, attr = name.rpartition(".")
        m = self.modules.get(module_name)
        if isinstance(m, (Linear, ExpertSlot)) and attr in ("weight", "bias"):
            self.pending.setdefault(module_name, {})[attr] = tensor
        elif isinstance(m, RMSNorm) and attr == "weight":
            m.weight = self._checked(name, tensor, (m.dim,)).to(self.dtype)
        elif isinstance(m, Embedding) and attr == "weight":
            m.weight = self._checked(name, tensor, (m.num_embeddings, m.embedding_dim)).to(self.dtype)
            self.infos[module_name] = LayerInfo(
                module_name, "embedding", f"dense {_dtype_name(m.weight.dtype)} {m.num_embeddings}x{m.embedding_dim}",
                None, None, None, "lookup", (), tensor.numel() * tensor.element_size(), tensor.numel())
        elif not IGNORED_TENSORS.search(name):
            self.unexpected.append(name)

    def _checked(self, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if not t.is_floating_point():
            raise CheckpointError(f"{self.where}: tensor '{name}' has dtype {t.dtype}, expected a float dtype")
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{self.where}: tensor '{name}' has shape {list(t.shape)}, "
                                  f"the model expects {list(shape)}")
        return t

    # ---- quantized layers --------------------------------------------------
    def quantized(self, name: str, qw: QuantizedWeight) -> None:
        name = self._canonical(name)
        m = self.modules.get(name)
        if isinstance(m, Embedding):
            self._check_qshape(name, qw, m.num_embeddings, m.embedding_dim)
            m.quantized = qw
            g = "ch" if qw.per_channel else f"g{qw.group_size}"
            self.infos[name] = LayerInfo(
                name, "embedding", f"W{qw.bits} {g} {'sym' if qw.symmetric else 'asym'} rows dequantized on lookup",
                qw.bits, qw.group_size, qw.symmetric, "lookup", (), qw.storage_bytes(), qw.codes.numel())
            return
        if isinstance(m, ExpertSlot):  # kept canonical: its MoE block prepares all experts at once
            self._check_qshape(name, qw, m.out_features, m.in_features)
            bias = self._bias(name, m, qw.bias)
            self.pending.pop(name, None)
            m.fill(name, qw.with_(bias=bias, name=name), self.ctx)
            self.progress.update(1)
            return
        if not isinstance(m, Linear):
            self.unexpected.append(f"{name} (quantized layer)")
            return
        self._check_qshape(name, qw, m.out_features, m.in_features)
        bias = self._bias(name, m, qw.bias)
        self.pending.pop(name, None)
        qw = qw.with_(bias=bias, name=name)
        m.impl = build_quant_linear(qw, self.selector, self.activation, bias_dtype=self.dtype)
        self.infos[name] = _quant_info(name, m.impl, "quantized")
        self.progress.update(1)
        release_freed_memory()

    def _check_qshape(self, name: str, qw: QuantizedWeight, out: int, inp: int) -> None:
        if (qw.out_features, qw.in_features) != (out, inp):
            raise CheckpointError(f"{self.where}: quantized layer '{name}' is [{qw.out_features}, "
                                  f"{qw.in_features}], the model expects [{out}, {inp}]")

    def _bias(self, name: str, m: Linear, bias: torch.Tensor | None) -> torch.Tensor | None:
        if bias is None:
            bias = self.pending.get(name, {}).get("bias")
        if bias is not None and not m.has_bias:
            raise CheckpointError(f"{self.where}: layer '{name}' has a bias in the checkpoint, but this "
                                  "architecture has none there")
        if bias is None and m.has_bias:
            raise CheckpointError(f"{self.where}: layer '{name}': tensor '{name}.bias' is missing")
        if bias is not None:
            self._checked(f"{name}.bias", bias, (m.out_features,))
        return bias

    # ---- completion --------------------------------------------------------
    def finish(self) -> list[LayerInfo]:
        for name, parts in self.pending.items():
            m = self.modules[name]
            if "weight" not in parts:
                continue  # reported as missing below
            w = self._checked(f"{name}.weight", parts["weight"], (m.out_features, m.in_features))
            bias = self._bias(name, m, parts.get("bias"))
            if isinstance(m, ExpertSlot):
                m.fill(name, DenseWeight(w, bias, name), self.ctx)
            else:
                m.impl = build_dense_linear(name, w, bias, self.dtype, self.selector)
                self.infos[name] = _dense_info(name, m.impl)
            self.progress.update(1)
        self._tie_lm_head()
        if self.unexpected:
            more = f" and {len(self.unexpected) - 5} more" if len(self.unexpected) > 5 else ""
            raise CheckpointError(f"{self.where}: tensors the {self.model.args.model_type} architecture has no "
                                  f"place for: {', '.join(self.unexpected[:5])}{more}")
        self._check_complete()
        for m in self.model.modules():
            if isinstance(m, PostLoad):
                m.post_load()
        for n, m in self.modules.items():
            if isinstance(m, ExpertSlot):
                self.infos[n] = LayerInfo(n, "expert", kernel=m.kernel_name, refusals=m.refusals,
                                          num_weights=m.in_features * m.out_features, **m.facts)
        return [self.infos[n] for n, m in self.modules.items() if isinstance(m, (Linear, Embedding, ExpertSlot))]

    def _tie_lm_head(self) -> None:
        head = self.modules.get("lm_head")
        if not isinstance(head, Linear) or head.filled or not self.model.tied_embeddings:
            return  # a checkpoint that stores lm_head keeps its own, tied or not
        emb = self.modules["model.embed_tokens"]
        if emb.weight is not None:
            head.impl = build_dense_linear("lm_head", emb.weight, None, self.dtype, self.selector)
            head.impl.weight_bytes = 0  # shares the embedding's storage
            self.infos["lm_head"] = _dense_info("lm_head", head.impl, "tied")
        elif emb.quantized is not None:
            head.impl = build_quant_linear(emb.quantized.with_(name="lm_head", bias=None), self.selector,
                                           self.activation, bias_dtype=self.dtype)
            self.infos["lm_head"] = _quant_info("lm_head", head.impl, "tied")
        release_freed_memory()

    def _check_complete(self) -> None:
        for name, m in self.modules.items():
            if isinstance(m, (Linear, Embedding, RMSNorm)) and not m.filled:  # experts: their block says
                what = "quantized layer or tensor" if isinstance(m, Linear) else "tensor"
                raise CheckpointError(f"{self.where}: the checkpoint has no {what} for '{name}' "
                                      f"(expected '{name}.weight')")


def _quant_info(name: str, ql, kind: str) -> LayerInfo:
    c = ql.config
    return LayerInfo(name, kind, c.summary(), c.bits, c.group_size, c.symmetric, ql.kernel_name,
                     ql.selection.refusals, 0 if kind == "tied" else ql.weight_bytes, c.in_features * c.out_features)


def _dense_info(name: str, dl, kind: str = "dense") -> LayerInfo:
    summary = f"dense {_dtype_name(dl.dtype)} {dl.out_features}x{dl.in_features}"
    return LayerInfo(name, kind, summary, None, None, None, dl.kernel_name, (), dl.weight_bytes,
                     dl.in_features * dl.out_features)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _largest_layer_bytes(model: nn.Module) -> int:
    """float32 bytes of the biggest decoder layer's linears (one layer unpacked in flight)."""
    slots = (Linear, ExpertSlot)
    sizes = [sum(m.in_features * m.out_features * 4 for m in layer.modules() if isinstance(m, slots))
             for layer in model.model.layers]
    return max(sizes, default=0)


def build_model(checkpoint, selector: KernelSelector, dtype: torch.dtype = torch.float32,
                activation: str | None = None, progress: bool = False,
                moe_selector: MoESelector | None = None) -> LoadedModel:
    """Build the architecture named by ``checkpoint.config`` and fill it from ``checkpoint``.

    ``checkpoint`` is anything with the Checkpoint interface: ``config``,
    ``dense_tensors()``, ``quantized_layers()`` (safetensors directories, GGUF files).
    ``moe_selector`` chooses MoE backends (default: the default policy on ``selector``'s platform).
    """
    where = str(getattr(checkpoint, "path", "checkpoint"))
    module = model_module(checkpoint.config.get("model_type"))
    model = module.Model(module.ModelArgs.from_dict(checkpoint.config), dtype)
    n_slots = sum(1 for m in model.modules() if isinstance(m, (Linear, ExpertSlot)))
    ctx = LoadContext(selector, moe_selector or MoESelector(selector.platform), activation, dtype)
    meter = MemoryMeter()
    with tqdm(total=n_slots, desc="loading", unit="layer", file=sys.stderr, disable=not progress,
              leave=False) as bar:
        filler = _SlotFiller(model, ctx, where, bar)
        for name, tensor in checkpoint.dense_tensors():
            filler.dense(name, tensor)
        for name, qw in checkpoint.quantized_layers():
            filler.quantized(name, qw)
        infos = filler.finish()
    memory = meter.finish(_largest_layer_bytes(model))
    model.eval()
    return LoadedModel(model, checkpoint, Path(where), infos, memory, dtype)


def load_model(path: str | os.PathLike, selector: KernelSelector, dtype: torch.dtype = torch.float32,
               activation: str | None = None, progress: bool = False,
               moe_selector: MoESelector | None = None) -> LoadedModel:
    """Open a checkpoint directory or ``.gguf`` file and build its model."""
    return build_model(open_checkpoint(path), selector, dtype, activation, progress, moe_selector)
