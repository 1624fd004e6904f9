"""The engine's memory pools, sized from one budget: paged KV blocks and, for hybrid models, the
per-sequence recurrent states (``EngineConfig.kv_cache_memory`` or a fraction of free RAM covers both).
With a draft model (speculative decoding) the budget is split between the target's and the draft's KV
in proportion to their bytes per token: both get the same number of blocks, so a sequence the target
holds always fits the draft too.

A model with sliding-window layers (Gemma 3, Gemma 4, gpt-oss) gets two block groups: its global layers'
(and the draft's) blocks, and its local layers' (quill.engine.window_blocks), which a sequence gives back
as its window slides.  The local group gets what ``max_num_seqs`` sequences can hold at once
(``window_blocks_needed``) and the global group the rest; a budget too small for that gives both groups
the same number of blocks (the local group then never holds more than the global one: as before, no
saving, never a shortfall)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from quill.engine.kv_cache import PagedKVCache
from quill.engine.memory import available_ram
from quill.engine.state_cache import StatePool, state_bytes
from quill.engine.window_blocks import WindowBlocks, window_blocks_needed
from quill.errors import ConfigError, GenerationError

log = logging.getLogger("quill.engine")


@dataclass
class Pools:
    """What ``build_pools`` made."""

    cache: PagedKVCache
    states: StatePool | None
    num_blocks: int  # the global group's blocks (every layer's, without sliding-window layers)
    draft_cache: PagedKVCache | None
    window: WindowBlocks | None  # the local layers' block group, None: no sliding-window layers


def build_pools(model: nn.Module, config, context_length: int, isa: str | None, draft: nn.Module | None = None
                ) -> Pools:
    """The pools of ``model`` (and a ``draft`` model) under ``config`` (an EngineConfig); ``isa``: the native
    variant decode attention runs, None for torch."""
    args = model.args
    kv_dtype = getattr(torch, "float16" if config.kv_cache_dtype == "auto" else config.kv_cache_dtype)
    # per decoder layer the per-sequence state it keeps instead of keys and values (None: KV cache)
    specs = getattr(model, "state_specs", lambda: None)()
    kv_layers = None if specs is None else [s is None for s in specs]
    # per decoder layer its pool's (kv heads, head dim), None: no pool (None: every layer the config's)
    shapes = getattr(model, "kv_layer_shapes", lambda: None)()
    if shapes is None:
        kv = kv_layers or [True] * args.num_hidden_layers
        shapes = [(args.num_key_value_heads, args.head_dim) if kv[i] else None for i in range(args.num_hidden_layers)]
    windows = layer_windows(model)
    local = frozenset(i for i, s in enumerate(shapes) if s is not None and windows[i] is not None)
    bs = config.block_size
    global_block = PagedKVCache.bytes_per_block(0, bs, 0, 0, kv_dtype, [s if i not in local else None
                                                                        for i, s in enumerate(shapes)])
    local_block = PagedKVCache.bytes_per_block(0, bs, 0, 0, kv_dtype, [shapes[i] for i in sorted(local)])
    state_total = 0 if specs is None else config.max_num_seqs * state_bytes(specs)
    # the draft's blocks pair with the global group's, one for one: the split in proportion to bytes per token
    global_block += 0 if draft is None else _draft_bytes_per_block(draft, config, kv_dtype)
    window = max((w for w in windows if w is not None), default=None) if local else None
    cap = 0 if window is None else window_blocks_needed(window, bs, config.max_num_seqs,
                                                        config.max_num_batched_tokens)
    full = config.max_num_seqs * (-(-context_length // bs) + 1)  # every sequence at full context
    needed = full * global_block + (cap + 1) * local_block
    num_blocks, local_blocks = split_budget(_kv_bytes(config, needed, global_block + local_block, state_total),
                                            global_block, local_block, cap, full)
    cache = PagedKVCache(args.num_hidden_layers, num_blocks, bs, args.num_key_value_heads, args.head_dim, kv_dtype,
                         isa, None, shapes, local, local_blocks + (1 if local else 0))  # + the null block
    blocks = None if not local else WindowBlocks(local_blocks, bs, window)
    if blocks is not None:
        log.info("KV blocks: %d for the %d global layers, %d for the %d sliding-window layers (window %d; "
                 "blocks out of it are freed: at most %d per sequence between steps)", num_blocks,
                 sum(s is not None for s in shapes) - len(local), local_blocks, len(local), window,
                 (window - 2) // bs + 2)
    draft_cache = None if draft is None else _draft_cache(draft, num_blocks, config, kv_dtype, isa)
    return Pools(cache, None if specs is None else StatePool(specs, config.max_num_seqs), num_blocks, draft_cache,
                 blocks)


def layer_windows(model: nn.Module) -> list[int | None]:
    """Each decoder layer's sliding window (None: global), as the model's config gives it; checked against the
    windows its layers attend with where it describes them (freeing what a layer still reads would be wrong)."""
    args = model.args
    window = getattr(args, "layer_window", None)
    windows = [None if window is None else window(i) for i in range(args.num_hidden_layers)]
    specs = getattr(model, "decoder_layer_specs", lambda: None)() or []
    for i, spec in enumerate(specs):
        attends = getattr(spec.attention, "window", windows[i])  # (a recurrent layer has none, and no KV pool)
        if attends != windows[i]:
            raise GenerationError(f"layer {i} attends with window {attends}, its config says {windows[i]}: the "
                                  "KV cache would free blocks by the wrong window")
    return windows


def split_budget(budget: int, global_block: int, local_block: int, cap: int, full: int) -> tuple[int, int]:
    """(global blocks, local blocks, the null block not counted) from ``budget`` bytes: the local group gets
    ``cap`` blocks (all its sequences can hold) when the global group keeps as many; else both the same
    number.  Without local layers: (global blocks, 0).  ``full``: the global blocks every sequence at full
    context holds (the global group's size when it costs no memory: every layer local, no draft)."""
    if not local_block:
        return max(2, budget // global_block), 0
    if budget >= cap * global_block + (cap + 1) * local_block:
        rest = budget - (cap + 1) * local_block
        return max(cap, rest // global_block if global_block else full), cap
    both = max(2, (budget - local_block) // (global_block + local_block))
    return both, both


def _draft_bytes_per_block(draft: nn.Module, config, kv_dtype: torch.dtype) -> int:
    a = draft.args
    if getattr(draft, "state_specs", lambda: None)() is not None:
        raise ConfigError("speculative_config.model: the draft keeps per-sequence recurrent state, which a "
                          "rejected draft token would corrupt; supported: a draft with a KV cache only")
    return PagedKVCache.bytes_per_block(a.num_hidden_layers, config.block_size, a.num_key_value_heads, a.head_dim,
                                        kv_dtype, getattr(draft, "kv_layer_shapes", lambda: None)())


def _draft_cache(draft: nn.Module, num_blocks: int, config, kv_dtype: torch.dtype, isa: str | None) -> PagedKVCache:
    a = draft.args
    return PagedKVCache(a.num_hidden_layers, num_blocks, config.block_size, a.num_key_value_heads, a.head_dim,
                        kv_dtype, isa, None, getattr(draft, "kv_layer_shapes", lambda: None)())


def _pool_bytes(config, needed: int) -> int:
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    # a fraction of free RAM, but never more than every sequence at full context needs
    return min(int(available_ram() * config.kv_cache_fraction), needed)


def _kv_bytes(config, needed: int, per_block: int, state_total: int) -> int:
    """What the KV blocks get of the budget once ``state_total`` bytes of recurrent state are set aside
    (``needed``: bytes of KV every sequence at full context needs; ``per_block``: one block of each group)."""
    if not state_total:
        return _pool_bytes(config, needed)
    budget = _pool_bytes(config, needed) + (0 if config.kv_cache_memory is not None else state_total)
    if budget - state_total < 2 * per_block:
        raise GenerationError(f"EngineConfig.kv_cache_memory: {budget} bytes hold neither the recurrent state "
                              f"of max_num_seqs={config.max_num_seqs} sequences ({state_total} bytes) and "
                              f"two KV blocks ({2 * per_block} bytes); give more or lower max_num_seqs")
    return budget - state_total
