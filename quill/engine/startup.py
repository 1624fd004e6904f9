"""Getting a model ready: from the prepacked cache when it holds it, else from the checkpoint (then cached).

    started = load_model(path, ctx, tokenizer=True, progress=False, cache=PrepackedCache())

A hit reads the kernel layouts straight into place (one pass over one file, checked) while
the tokenizer is built, and never opens the checkpoint's weights.  A miss loads as always,
answers, and writes the cache file on a thread.  A cache file that fails any check (size,
checksum, a kernel chosen differently now, a slot this model lacks) is deleted with a warning
and the load goes on from the checkpoint: the cache can cost time, never correctness.
"""

from __future__ import annotations

import gc
import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from quill.engine.loader import LoadedModel, build_model, restore_loaded
from quill.engine.memory import release_freed_memory
from quill.errors import NotCacheable, QuillError
from quill.formats.checkpoint import open_checkpoint
from quill.layers import LoadContext
from quill.layers.snapshot import save_model
from quill.prepacked.store import CacheKey, PrepackedCache
from quill.tokenizer_spec import TokenizerSpec

log = logging.getLogger("quill.prepacked")


@dataclass
class Started:
    """A loaded model and what came with it."""

    loaded: LoadedModel
    tokenizer: TokenizerSpec | None
    eos_token_ids: tuple[int, ...]  # the checkpoint's own (a run without a tokenizer uses them)
    cache_hit: bool = False


@dataclass(frozen=True)
class CachedCheckpoint:
    """What a load from the prepacked cache knows of its checkpoint (``quill inspect``'s format line)."""

    path: Path
    config: dict
    description: str
    cache_file: Path

    def describe(self) -> str:
        return f"{self.description}; loaded from the prepacked cache {self.cache_file}"


@contextmanager
def _collector_paused():
    """No garbage collection while loading: the objects a load makes (modules, parsed headers, configs) all
    live on, and a full collection midway walks torch's whole object graph (~60 ms on the default model)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def load_model(path: Path, ctx: LoadContext, *, tokenizer: bool, progress: bool,
               cache: PrepackedCache | None) -> Started:
    """The model at ``path`` under ``ctx``'s kernel choice; ``tokenizer``: also its tokenizer."""
    with _collector_paused():
        started = _load(path, ctx, tokenizer, progress, cache)
    release_freed_memory()  # parsing (the tokenizer's JSON above all) leaves freed heap the OS can have back
    return started


def _load(path: Path, ctx: LoadContext, tokenizer: bool, progress: bool, cache: PrepackedCache | None) -> Started:
    key = _key(cache, path, ctx) if cache is not None else None
    if key is not None:
        started = _from_cache(cache, key, path, ctx, tokenizer)
        if started is not None:
            return started
    checkpoint = open_checkpoint(path)
    loaded = build_model(checkpoint, progress=progress, ctx=ctx)
    spec = checkpoint.tokenizer_spec() if tokenizer else None
    eos = tuple(checkpoint.eos_token_ids())
    release = getattr(checkpoint, "release_pages", None)  # a memory map read through once (GGUF)
    if release is not None:
        release()
    if key is not None:
        _save(cache, key, loaded, checkpoint, spec, eos)  # written on a thread (PrepackedCache.wait joins it)
    return Started(loaded, spec, eos)


def _key(cache: PrepackedCache, path: Path, ctx: LoadContext) -> CacheKey | None:
    try:
        return cache.key(path, ctx.choice())
    except OSError as e:  # an unreadable cache directory: load without it
        log.warning("prepacked cache: not used (%s)", e)
        return None


def _from_cache(cache: PrepackedCache, key: CacheKey, path: Path, ctx: LoadContext,
                tokenizer: bool) -> Started | None:
    pending = cache.open(key)
    if pending is None:
        return None
    try:
        facts = pending.facts
        spec = None
        if tokenizer:  # built while the weights are read (the read holds no lock)
            saved = pending.tokenizer_json
            spec = (TokenizerSpec.from_saved(saved, facts["tokenizer"]) if saved is not None
                    else open_checkpoint(path).tokenizer_spec())
        source = CachedCheckpoint(path, facts["config"], facts["description"], pending.path)
        data = pending.data()
        loaded = restore_loaded(facts["config"], facts["records"], data.tensors, ctx, source, path,
                                sparse=data.drop_pages)
        return Started(loaded, spec, tuple(facts["eos_token_ids"]), True)
    # anything wrong with the file, or gone (another process made room or cleared the cache): rebuild it
    except (QuillError, KeyError, TypeError, ValueError, OSError) as e:
        pending.settle()
        cache.discard(pending.path, e)
        return None


def _save(cache: PrepackedCache, key: CacheKey, loaded: LoadedModel, checkpoint, spec: TokenizerSpec | None,
          eos: tuple[int, ...]) -> None:
    def export():
        records, tensors = save_model(loaded.model)
        facts = {"source": str(loaded.path), "description": checkpoint.describe(),
                 "model_type": checkpoint.config.get("model_type"), "config": checkpoint.config, "records": records,
                 "kernels": sorted({i.kernel for i in loaded.layers}), "eos_token_ids": list(eos),
                 "tokenizer": None if spec is None else spec.facts()}
        json.dumps(facts)  # JSON-able now, or not cached (the write runs on a thread)
        return facts, tensors, {} if spec is None else {"tokenizer": spec.tokenizer.to_str()}
    try:
        cache.save(key, export)
    except (NotCacheable, TypeError, ValueError, OSError) as e:
        log.info("prepacked cache: %s not cached (%s)", loaded.path, e)
