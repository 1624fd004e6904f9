"""The KV blocks of local (sliding-window) layers: a block group of their own, freed as the window slides.

A model whose layers mix global attention with sliding windows (Gemma 3, Gemma 4, gpt-oss) keeps its
local layers' pools apart from the global ones (vLLM's hybrid KV cache: one block group per attention
kind).  The global group is ``block_manager.BlockManager``'s, as for any model.  The local group is this:

* each sequence has a second block table (``Sequence.window_table``) indexed like its first (logical block
  i holds positions i * block_size ..); entries before the window are ``NULL``, the pool's block 0, which
  is never handed out and never read (attention masks those positions: decode and prefill, torch and
  native, read only the last W of them);
* blocks are taken lazily, only for the positions a step computes (``cover``), and given back as soon
  as no later query of any local layer can read them (``slide``: a query at p reads p - W + 1 .. p, W the
  largest local window), so a sequence holds at most ``(W - 2) // block_size + 2`` blocks between steps,
  plus the blocks of the chunk it computes;
* prefix caching: a local block is cached only as the *twin* of the global block computed in the same
  step for the same positions (``register``), and a cached prefix is reused only as far as the local
  group still holds the twins of the blocks its first query's window reads (``reusable``, vLLM's rule:
  a sliding group's hit needs only its window, the blocks before stay NULL).  A twin evicted from either
  pool ends the pairing (``forget``);
* preemption frees the group's blocks with the others; the recompute starts from the prompt.

The group never runs out on its own (``pools.build_pools`` sizes it so): a sequence holds a local block only
where it holds a global one, and a local block held by several sequences is the twin of the global block
they all hold (or it was computed by one whose global block there is private), so live local blocks are
never more than live global ones; nor more than ``window_blocks_needed`` for ``max_num_seqs`` sequences.
So admission and preemption are decided by the global group alone; running out here anyway is a bug,
raised as a GenerationError.
"""

from __future__ import annotations

from collections import OrderedDict

from quill.engine.sequence import Sequence
from quill.errors import GenerationError

NULL = 0  # block 0 of the local pool: a table's entry for a block out of the window (never allocated)


def window_blocks_needed(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Local blocks (the null block not counted) that ``max_num_seqs`` sequences can hold at once: each keeps
    the blocks its next query's window reads, at most ``(W - 2) // bs + 2`` (the window's W - 1 positions
    before it and its own may straddle one more block), + 1 for a block its chunk starts in, and one step's
    chunks, ``max_num_batched_tokens`` positions in all, add at most that many blocks more."""
    return max_num_seqs * ((window - 2) // block_size + 3) + max_num_batched_tokens // block_size


class WindowBlocks:
    """The local block group's bookkeeping: reference counts, a free list (least recently used first, cached
    twins kept as long as possible), and the twin pairing with the global group's cached blocks."""

    def __init__(self, num_blocks: int, block_size: int, window: int):
        """``num_blocks``: blocks that can be handed out (the pool holds one more: ``NULL``); ``window``: the
        largest window of the local layers."""
        if num_blocks < 1 or window < 1:
            raise GenerationError(f"a sliding-window block group needs a block and a window, found {num_blocks} "
                                  f"blocks, window {window}")
        self.num_blocks, self.block_size, self.window = num_blocks, block_size, window
        self.ref = [0] * (num_blocks + 1)
        self.twin_of: list[int | None] = [None] * (num_blocks + 1)  # the global block it is cached beside
        self.twin: dict[int, int] = {}  # cached global block -> its local twin
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks + 1))
        self._cached_free = 0

    # ---- facts ---------------------------------------------------------------
    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_cached_free(self) -> int:
        return self._cached_free

    def first_read(self, position: int) -> int:
        """The first logical block a local query at ``position`` reads."""
        return max(0, position - self.window + 1) // self.block_size

    @staticmethod
    def held(seq: Sequence) -> int:
        """Local blocks ``seq`` holds (its table's entries other than NULL)."""
        return sum(b != NULL for b in seq.window_table)

    # ---- prefix caching --------------------------------------------------------
    def reusable(self, hits: list[int]) -> int:
        """How many of the global group's prefix-cache ``hits`` (blocks 0 ..) may be reused: the most h whose
        first query (position h * block_size) finds every block its window reads still twinned here."""
        last_missing = -1  # the last index below h whose global block has no local twin
        best = 0
        for h in range(1, len(hits) + 1):
            if hits[h - 1] not in self.twin:
                last_missing = h - 1
            if last_missing < self.first_read(h * self.block_size):
                best = h
        return best

    def take_hits(self, seq: Sequence, hits: list[int]) -> None:
        """``seq`` reuses a cached prefix of ``len(hits)`` blocks (``reusable`` said so): its table gets the
        twins of the blocks its window reads, NULL before them."""
        start = self.first_read(len(hits) * self.block_size) if hits else 0
        seq.window_table = [NULL] * start
        for g in hits[start:]:
            block = self.twin[g]
            self._use(block)
            seq.window_table.append(block)
        seq.window_freed = start

    def register(self, seq: Sequence, index: int, global_block: int) -> None:
        """``global_block`` is cached for ``seq``'s logical block ``index`` (``seq``'s own, or the same tokens'
        computed before): ``seq``'s local block there becomes its twin, unless it has one.  A twin changes only
        once the old one was evicted (no sequence held it), which keeps the count below."""
        block = seq.window_table[index] if index < len(seq.window_table) else NULL
        if block != NULL and self.twin_of[block] is None and global_block not in self.twin:
            self.twin_of[block] = global_block
            self.twin[global_block] = block

    def forget(self, global_block: int) -> None:
        """The global group evicted ``global_block``: its twin is cached no more (a sequence may still hold it)."""
        block = self.twin.pop(global_block, None)
        if block is not None:
            self.twin_of[block] = None
            self._cached_free -= self.ref[block] == 0

    # ---- allocation --------------------------------------------------------------
    def _use(self, block: int) -> None:
        if self.ref[block] == 0:
            del self.free[block]
            self._cached_free -= self.twin_of[block] is not None
        self.ref[block] += 1

    def _take(self, seq: Sequence) -> int:
        if not self.free:  # the sizing rule (module docstring) makes this impossible
            raise GenerationError(f"request {seq.request_id}: the sliding-window block group ({self.num_blocks} "
                                  f"blocks) ran out; it is sized never to, so this is a bug in quill")
        block, _ = self.free.popitem(last=False)
        if self.twin_of[block] is not None:  # evict its cached content
            del self.twin[self.twin_of[block]]
            self.twin_of[block] = None
            self._cached_free -= 1
        self.ref[block] = 1
        return block

    def _release(self, block: int, reuse_first: bool = False) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free[block] = None
            if reuse_first:
                self.free.move_to_end(block, last=False)
            self._cached_free += self.twin_of[block] is not None

    def cover(self, seq: Sequence, end: int) -> None:
        """Blocks for ``seq``'s positions up to ``end`` (exclusive): what a step computes."""
        while len(seq.window_table) * self.block_size < end:
            seq.window_table.append(self._take(seq))

    def slide(self, seq: Sequence) -> None:
        """Give back the blocks no later query of ``seq`` reads (those before the window of position
        ``num_computed``, the next one computed); they keep their cached content, if any."""
        first = min(self.first_read(seq.num_computed), len(seq.window_table))
        table = seq.window_table
        for i in range(seq.window_freed, first):
            if table[i] != NULL:
                self._release(table[i])
                table[i] = NULL
        seq.window_freed = max(seq.window_freed, first)

    def trim(self, seq: Sequence, keep: int) -> None:
        """Drop ``seq``'s blocks past its first ``keep`` (rejected drafts' positions; taken first again)."""
        while len(seq.window_table) > keep:
            block = seq.window_table.pop()
            if block != NULL:
                self._release(block, reuse_first=True)

    def free_all(self, seq: Sequence) -> None:
        for block in reversed(seq.window_table):
            if block != NULL:
                self._release(block)
        seq.window_table, seq.window_freed = [], 0
