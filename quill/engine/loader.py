"""Load a checkpoint into a model: resolve the path, build the architecture, fill every slot.

    loaded = build_model(open_checkpoint("path/to/checkpoint"), ctx=LoadContext.create(platform, torch.float32))
    logits = loaded.model(tokens, forward_ctx)

Dense tensors (norms, embeddings, layers the checkpoint left unquantized) are
memory-mapped and read first; quantized layers are then streamed one at a time,
each repacked by its kernel as it arrives, so only one layer is ever unpacked.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from quill.canonical import QuantizedWeight
from quill.engine.memory import LoadMemory, MemoryMeter, release_freed_memory
from quill.errors import CheckpointError
from quill.layers import ExpertSlot, LayerInfo, Linear, LoadContext, PostLoad, Slot
from quill.layers.snapshot import restore_model
from quill.models import model_module

# Tensors some checkpoints carry that the model recomputes (older HF exports store rotary tables).
IGNORED_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

log = logging.getLogger("quill.engine")

__all__ = ["IGNORED_TENSORS", "LayerInfo", "LoadedModel", "build_model", "restore_loaded"]


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


class _Router:
    """Routes each checkpoint tensor or quantized layer to the slot of the same name; slots do the rest."""

    def __init__(self, model: nn.Module, ctx: LoadContext, progress: tqdm):
        self.model, self.ctx, self.progress = model, ctx, progress
        self.slots = {n: m for n, m in model.named_modules() if isinstance(m, Slot)}
        # checkpoint spellings the architecture also accepts (e.g. Mixtral experts' gate_proj for w1)
        self.aliases = [(re.compile(pattern), repl) for pattern, repl in model.checkpoint_aliases]
        self.unexpected: list[str] = []
        # tensors of parts the model does not run (a multimodal checkpoint's vision tower): skipped, logged once
        skipped = getattr(model, "skipped_tensors", None)
        self.skipped = re.compile(skipped) if skipped else None
        self.num_skipped = 0
        self.arrived: dict[str, None] = {}  # slots that took dense tensors, in checkpoint order

    def _canonical(self, name: str) -> str:
        for pattern, repl in self.aliases:
            name = pattern.sub(repl, name)
        return name

    def _skip(self, name: str) -> bool:
        if self.skipped is None or not self.skipped.search(name):
            return False
        self.num_skipped += 1
        return True

    def dense(self, name: str, tensor: torch.Tensor) -> None:
        name = self._canonical(name)
        if self._skip(name):
            return
        module_name, _, attr = name.rpartition(".")
        slot = self.slots.get(module_name)
        if slot is not None and slot.load_tensor(module_name, attr, tensor, self.ctx):
            self.arrived[module_name] = None
        elif not IGNORED_TENSORS.search(name):
            self.unexpected.append(name)

    def quantized(self, name: str, qw: QuantizedWeight) -> None:
        name = self._canonical(name)
        if self._skip(name):
            return
        slot = self.slots.get(name)
        if slot is None or not slot.load_quantized(name, qw, self.ctx):
            self.unexpected.append(f"{name} (quantized layer)")
            return
        self.progress.update(1)
        release_freed_memory()

    def finish(self) -> list[LayerInfo]:
        if self.num_skipped:
            log.info("%s: %d tensors skipped (%s: parts the %s text model does not run, e.g. a vision tower)",
                     self.ctx.where, self.num_skipped, self.skipped.pattern, self.model.args.model_type)
        for name in self.arrived:  # checkpoint order, so the first bad tensor is the one reported
            if self.slots[name].finish(name, self.ctx):
                self.progress.update(1)
        self._tie_lm_head()
        if self.unexpected:
            more = f" and {len(self.unexpected) - 5} more" if len(self.unexpected) > 5 else ""
            raise CheckpointError(f"{self.ctx.where}: tensors the {self.model.args.model_type} architecture has no "
                                  f"place for: {', '.join(self.unexpected[:5])}{more}")
        for name, slot in self.slots.items():
            slot.check_filled(name, self.ctx)
        for m in self.model.modules():
            if isinstance(m, PostLoad):
                m.post_load()
        infos = (slot.info(name) for name, slot in self.slots.items())
        return [i for i in infos if i is not None]

    def _tie_lm_head(self) -> None:
        head = self.slots.get("lm_head")
        if not isinstance(head, Linear) or head.filled or not self.model.tied_embeddings:
            return  # a checkpoint that stores lm_head keeps its own, tied or not
        head.tie(self.slots["model.embed_tokens"], self.ctx)
        release_freed_memory()


def _largest_layer_bytes(model: nn.Module) -> int:
    """float32 bytes of the biggest decoder layer's linears (one layer unpacked in flight)."""
    sizes = [sum(m.in_features * m.out_features * 4 for m in layer.modules() if isinstance(m, (Linear, ExpertSlot)))
             for layer in model.model.layers]
    return max(sizes, default=0)


def build_model(checkpoint, selector=None, dtype: torch.dtype = torch.float32, activation: str | None = None,
                progress: bool = False, moe_selector=None, ctx: LoadContext | None = None) -> LoadedModel:
    """Build the architecture named by ``checkpoint.config`` and fill it from ``checkpoint``.

    ``checkpoint`` is anything with the Checkpoint interface: ``config``,
    ``dense_tensors()``, ``quantized_layers()`` (safetensors directories, GGUF files).
    Kernel choice comes from ``ctx`` (a :class:`quill.layers.LoadContext`), or is built
    around a kernel ``selector`` (and ``moe_selector``; default: the default policy on
    ``selector``'s platform) with ``dtype`` and ``activation``.
    """
    where = str(getattr(checkpoint, "path", "checkpoint"))
    if ctx is None:
        ctx = LoadContext.from_selector(selector, dtype, activation, moe_selector, where)
    else:
        ctx = dataclasses.replace(ctx, where=where)
    module = model_module(checkpoint.config.get("model_type"))
    model = module.Model(module.ModelArgs.from_dict(checkpoint.config), ctx.dtype)
    n_slots = sum(1 for m in model.modules() if isinstance(m, (Linear, ExpertSlot)))
    meter = MemoryMeter()
    # delay: a load done within a second shows no bar at all
    with tqdm(total=n_slots, desc="loading", unit="layer", file=sys.stderr, disable=not progress,
              leave=False, delay=1.0) as bar:
        router = _Router(model, ctx, bar)
        for name, tensor in checkpoint.dense_tensors():
            router.dense(name, tensor)
        for name, qw in checkpoint.quantized_layers():
            router.quantized(name, qw)
        infos = router.finish()
    memory = meter.finish(_largest_layer_bytes(model))
    model.eval()
    return LoadedModel(model, checkpoint, Path(where), infos, memory, ctx.dtype)


def restore_loaded(config: dict, records: dict, tensors: dict[str, torch.Tensor], ctx: LoadContext,
                   checkpoint: Any, path: Path, sparse=None) -> LoadedModel:
    """Build the architecture ``config`` names and fill it from a prepacked cache's slots (quill.layers.snapshot):
    what :func:`build_model` gives, without reading the checkpoint's weights.  ``sparse(tensor)`` is called
    for the tables a model reads a few rows at a time (embeddings)."""
    ctx = dataclasses.replace(ctx, where=str(path))
    module = model_module(config.get("model_type"))
    model = module.Model(module.ModelArgs.from_dict(config), ctx.dtype)
    meter = MemoryMeter()
    infos = restore_model(model, records, tensors, ctx, sparse)
    memory = meter.finish(_largest_layer_bytes(model))
    model.eval()
    return LoadedModel(model, checkpoint, path, infos, memory, ctx.dtype)
