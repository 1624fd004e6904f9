"""The engine's memory pools, sized from one budget: paged KV blocks and, for hybrid models, the
per-sequence recurrent states (``EngineConfig.kv_cache_memory`` or a fraction of free RAM covers both).
With a draft model (speculative decoding) the budget is split between the target's and the draft's KV
in proportion to their bytes per token: both get the same number of blocks, so a sequence the target
holds always fits the draft too."""

from __future__ import annotations

import torch
from torch import nn

from quill.engine.kv_cache import PagedKVCache
from quill.engine.memory import available_ram
from quill.engine.state_cache import StatePool, state_bytes
from quill.errors import ConfigError, GenerationError


def build_pools(model: nn.Module, config, context_length: int, isa: str | None, draft: nn.Module | None = None
                ) -> tuple[PagedKVCache, StatePool | None, int, PagedKVCache | None]:
    """(KV cache, recurrent-state pool or None, number of KV blocks, the draft's KV cache or None) for
    ``model`` (and a ``draft`` model) under ``config`` (an EngineConfig); ``isa``: the native variant decode
    attention runs, None for torch."""
    args = model.args
    kv_dtype = getattr(torch, "float16" if config.kv_cache_dtype == "auto" else config.kv_cache_dtype)
    # per decoder layer the per-sequence state it keeps instead of keys and values (None: KV cache)
    specs = getattr(model, "state_specs", lambda: None)()
    kv_layers = None if specs is None else [s is None for s in specs]
    # per decoder layer its pool's (kv heads, head dim), None: no pool (None: every layer the config's)
    shapes = getattr(model, "kv_layer_shapes", lambda: None)()
    per_block = PagedKVCache.bytes_per_block(args.num_hidden_layers if specs is None else sum(kv_layers),
                                             config.block_size, args.num_key_value_heads, args.head_dim,
                                             kv_dtype, shapes)
    state_total = 0 if specs is None else config.max_num_seqs * state_bytes(specs)
    draft_block = 0 if draft is None else _draft_bytes_per_block(draft, config, kv_dtype)
    # one block of each per block of the budget: the split in proportion to bytes per token
    both = per_block + draft_block
    num_blocks = max(2, _kv_bytes(config, context_length, both, state_total) // both)
    cache = PagedKVCache(args.num_hidden_layers, num_blocks, config.block_size, args.num_key_value_heads,
                         args.head_dim, kv_dtype, isa, kv_layers, shapes)
    draft_cache = None if draft is None else _draft_cache(draft, num_blocks, config, kv_dtype, isa)
    return cache, None if specs is None else StatePool(specs, config.max_num_seqs), num_blocks, draft_cache


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


def _pool_bytes(config, context_length: int, per_block: int) -> int:
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    # a fraction of free RAM, but never more than every sequence at full context needs
    needed = config.max_num_seqs * (-(-context_length // config.block_size) + 1) * per_block
    return min(int(available_ram() * config.kv_cache_fraction), needed)


def _kv_bytes(config, context_length: int, per_block: int, state_total: int) -> int:
    """What the KV blocks get of the budget once ``state_total`` bytes of recurrent state are set aside."""
    if not state_total:
        return _pool_bytes(config, context_length, per_block)
    budget = _pool_bytes(config, context_length, per_block) + (0 if config.kv_cache_memory is not None
                                                                else state_total)
    if budget - state_total < 2 * per_block:
        raise GenerationError(f"EngineConfig.kv_cache_memory: {budget} bytes hold neither the recurrent state "
                              f"of max_num_seqs={config.max_num_seqs} sequences ({state_total} bytes) and "
                              f"two KV blocks ({2 * per_block} bytes); give more or lower max_num_seqs")
    return budget - state_total
