"""A loaded model's slots as facts and tensors, and back: what the prepacked cache saves.

After a load every slot holds what it built (a kernel's repacked state, a norm's weight,
a quantized embedding in canonical form), and every MoE block its backend's state.
:func:`save_model` collects that, module by module (``Saved``), as JSON-able facts and
tensors named ``<module>:<field>``; :func:`restore_model` hands each module its part again,
so a later load skips format conversion and repacking.  Kernels and MoE backends save their
own state (``export_state``); one that cannot raises :class:`NotCacheable` and the model is
simply not cached.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

from quill.errors import CacheError
from quill.layers.context import LayerInfo, LoadContext
from quill.layers.slots import Embedding, Linear, PostLoad, Saved, Slot

SEPARATOR = ":"


def _saved(model: nn.Module) -> dict[str, Saved]:
    """Every module that saves its state (slots, MoE blocks), parents before their children."""
    return {n: m for n, m in model.named_modules() if isinstance(m, Saved)}


def save_model(model: nn.Module) -> tuple[dict[str, dict], dict[str, torch.Tensor]]:
    """({slot: facts}, {"<slot>:<field>": tensor}) of a loaded model; NotCacheable when a slot cannot be saved."""
    records: dict[str, dict] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, slot in _saved(model).items():
        records[name], own = slot.save(name)
        tensors.update({f"{name}{SEPARATOR}{k}": t for k, t in own.items()})
    return records, tensors


def restore_model(model: nn.Module, records: dict[str, dict], tensors: dict[str, torch.Tensor],
                  ctx: LoadContext, sparse: Callable[[torch.Tensor], None] | None = None) -> list[LayerInfo]:
    """Fill a freshly built ``model`` from :func:`save_model`'s output; the layers' infos, as a load gives.

    ``sparse(tensor)`` is called for every tensor of a slot that reads a few rows at a time (an embedding
    table; a memory-mapped source can then let its pages go until rows are looked up).
    A CacheError when the saved slots are not this model's, or a kernel chosen now differs from the saved one.
    """
    slots = _saved(model)
    if set(records) != set(slots):
        extra, missing = sorted(set(records) - set(slots)), sorted(set(slots) - set(records))
        raise CacheError(f"saved slots do not match the {model.args.model_type} model: "
                         f"unknown {extra[:3]}, missing {missing[:3]}")
    by_slot: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, t in tensors.items():
        name, _, field = key.rpartition(SEPARATOR)
        by_slot[name][field] = t
    for name, slot in slots.items():
        slot.restore(name, records[name], by_slot.get(name, {}), ctx)
        if sparse is not None and isinstance(slot, Embedding):
            for t in by_slot.get(name, {}).values():
                sparse(t)
    for name, slot in slots.items():
        if records[name].get("tied"):
            embedding = slots.get("model.embed_tokens")
            if not isinstance(slot, Linear) or not isinstance(embedding, Embedding):
                raise CacheError(f"{name}: saved as tied to the embedding, which this model does not have")
            slot.tie(embedding, ctx)
    for name, slot in slots.items():
        if isinstance(slot, Slot):
            slot.check_filled(name, ctx)
    for m in model.modules():
        if isinstance(m, PostLoad):
            m.post_load()
    infos = (slot.info(name) for name, slot in slots.items() if isinstance(slot, Slot))
    return [i for i in infos if i is not None]
