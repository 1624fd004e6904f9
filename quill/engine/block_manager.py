"""Fixed-size KV blocks from one pool: allocation, reference counts, prefix caching with LRU eviction.

A block holds ``block_size`` consecutive tokens of one sequence.  A *full* block whose
KV has been computed is keyed by a hash of its tokens and of everything before it
(the previous block's hash), so two prompts that start with the same tokens share
those blocks.  Blocks whose reference count drops to zero go to the back of the free
list with their content and hash kept: a later request may still hit them, and
allocation takes from the front, so the least recently used content is evicted first.

A model with sliding-window layers keeps their blocks in a second group (``window_blocks.WindowBlocks``,
``window``): lazily taken for the positions a step computes (``cover_window``) and given back as the window
slides past them; this manager's tables and counts stay the global layers' (and decide admission).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence as Seq

from quill.engine.sequence import Sequence
from quill.engine.window_blocks import WindowBlocks
from quill.errors import GenerationError


def block_hash(parent: bytes, tokens: Seq[int]) -> bytes:
    """The key of a full block: its tokens and its parent's key (so the whole prefix counts)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens))
    return h.digest()


class BlockManager:
    """The block pool's bookkeeping (the KV tensors themselves live in ``kv_cache.PagedKVCache``)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, states=None,
                 window: WindowBlocks | None = None):
        """``states``: a ``quill.engine.state_cache.StatePool`` whose slot each sequence holds beside its
        blocks (models with recurrent layers), or None; ``window``: the sliding-window layers' block group
        (models with local layers), or None."""
        if num_blocks < 1 or block_size < 1:
            raise GenerationError(f"a KV cache needs at least one block of one token, found {num_blocks} "
                                  f"blocks of {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.key: list[bytes | None] = [None] * num_blocks  # hash of a registered (computed, full) block
        self.by_key: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU at the front
        self._cached_free = 0  # free blocks whose key is still registered (kept in step with free / key)
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.states = states
        self.window = window

    # ---- facts ---------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks still holding reusable prefix content."""
        return self._cached_free

    # ---- allocation ------------------------------------------------------------
    def _prefix_keys(self, tokens: Seq[int], limit: int) -> list[bytes]:
        keys, parent, bs = [], b"", self.block_size
        for i in range(limit // bs):
            parent = block_hash(parent, tokens[i * bs:(i + 1) * bs])
            keys.append(parent)
        return keys

    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)  # least recently used
        if self.key[block] is not None:  # evict its cached content
            del self.by_key[self.key[block]]
            self.key[block] = None
            self._cached_free -= 1
            if self.window is not None:  # its local twin is unreachable now
                self.window.forget(block)
        return block

    def _use(self, block: int) -> None:
        if self.ref[block] == 0:
            del self.free[block]
            self._cached_free -= self.key[block] is not None
        self.ref[block] += 1

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks of the prefix cache holding ``seq``'s leading tokens (at least one token is left to compute)."""
        if not self.prefix_caching:
            return []
        hits = []  # positions whose logits are wanted (prompt log-probs, scores) are never taken from the cache
        for key in self._prefix_keys(seq.tokens, seq.cacheable_tokens):
            block = self.by_key.get(key)
            if block is None:
                break
            hits.append(block)
        if self.window is not None:  # only as far as the local layers still hold what the first query's window reads
            hits = hits[:self.window.reusable(hits)]
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether the free list can hold ``seq``'s tokens beyond its cached prefix."""
        hits = self.cached_prefix(seq)
        reusable_free = sum(1 for b in hits if self.ref[b] == 0)
        return self.blocks_for(seq.num_tokens) - len(hits) <= self.num_free - reusable_free

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens, the leading ones from the prefix cache when they match."""
        if seq.block_table:
            raise GenerationError(f"request {seq.request_id}: blocks allocated twice")
        hits = self.cached_prefix(seq)
        for b in hits:
            self._use(b)
        new = [self._take_free() for _ in range(self.blocks_for(seq.num_tokens) - len(hits))]
        for b in new:
            self.ref[b] = 1
        seq.block_table = hits + new
        seq.num_hashed = len(hits)
        if self.window is not None:
            self.window.take_hits(seq, hits)
        if self.states is not None:
            seq.state_slot = self.states.take(seq.request_id)
        seq.num_computed = len(hits) * self.block_size
        if not seq.admitted:
            seq.num_cached, seq.admitted = min(seq.num_computed, len(seq.prompt)), True
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += seq.num_computed

    def can_append(self, seq: Sequence) -> bool:
        """Whether ``seq`` can take one more token (a new block only when its last one is full)."""
        return self.blocks_for(seq.num_tokens + 1) <= len(seq.block_table) or self.num_free >= 1

    def append_slot(self, seq: Sequence) -> None:
        """Make room for token ``seq.num_tokens`` (the one about to be computed)."""
        if self.blocks_for(seq.num_tokens) > len(seq.block_table):
            self._grow(seq)

    def cover_window(self, seq: Sequence, n: int) -> None:
        """Local blocks for the ``n`` positions ``seq`` computes this step (no-op without local layers)."""
        if self.window is not None:
            self.window.cover(seq, seq.num_computed + n)

    def _grow(self, seq: Sequence) -> None:
        """One free block onto the end of ``seq``'s table."""
        block = self._take_free()
        self.ref[block] = 1
        seq.block_table.append(block)

    def _release(self, block: int, reuse_first: bool = False) -> None:
        """One reference to ``block`` dropped; at none it is free (taken first if ``reuse_first``: it holds
        nothing a prompt could reuse; else last, kept for the prefix cache as long as possible)."""
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free[block] = None
            if reuse_first:
                self.free.move_to_end(block, last=False)
            self._cached_free += self.key[block] is not None

    def reserve_ahead(self, seq: Sequence, extra: int) -> int:
        """Room for ``extra`` positions past ``seq``'s tokens (speculative drafts) from free blocks only, never
        from another sequence; how many of them it got."""
        want = self.blocks_for(seq.num_tokens + extra) - len(seq.block_table)
        for _ in range(min(max(0, want), self.num_free)):
            self._grow(seq)
        return max(0, min(extra, len(seq.block_table) * self.block_size - seq.num_tokens))

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past ``seq``'s computed tokens (rejected drafts' positions).  They hold nothing
        reusable, so they go to the front of the free list, taken first."""
        keep = max(self.blocks_for(seq.num_computed), seq.num_hashed)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop(), reuse_first=True)
        if self.window is not None:
            self.window.trim(seq, self.blocks_for(seq.num_computed))

    def register_computed(self, seq: Sequence) -> None:
        """Key every full block whose KV is now computed, so later prompts can reuse it; then give back the
        local blocks the window has passed (after keying: a block keyed here may have its local twin freed)."""
        self._register(seq)
        if self.window is not None:
            self.window.slide(seq)

    def _register(self, seq: Sequence) -> None:
        if not self.prefix_caching:
            return
        full = seq.num_computed // self.block_size
        if full <= seq.num_hashed:
            return
        keys = self._prefix_keys(seq.tokens, full * self.block_size)
        for i in range(seq.num_hashed, full):
            block, key = seq.block_table[i], keys[i]
            if key not in self.by_key and self.key[block] is None:
                self.key[block] = key
                self.by_key[key] = block
            if self.window is not None and key in self.by_key:
                # the cached block's local twin: this one, unless it has one (its own, still cached)
                self.window.register(seq, i, self.by_key[key])
        seq.num_hashed = full

    def free_blocks(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (last first, so a prompt's tail is evicted before its head)."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_hashed = 0
        if self.window is not None:
            self.window.free_all(seq)
        if seq.state_slot is not None:
            self.states.release(seq.state_slot)
            seq.state_slot = None
