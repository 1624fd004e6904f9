"""Continuous batching: which sequences run this step, and how many of their tokens.

Every step (nano-vllm's scheduler, with chunked prefill):

1. every running sequence that is decoding gets its one token, oldest first; when one
   cannot grow (no free block), the newest running sequence is preempted (its blocks
   freed, back to the front of the queue, recomputed from its tokens later); then, with
   speculative decoding, each gets its drafts as far as free blocks and the budget allow and as far
   as they pay (quill.engine.spec_cost);
2. running sequences in the middle of a prefill get their next chunk;
3. waiting sequences are admitted while there are sequence slots, KV blocks and token
   budget, each with as much of its prompt as the budget allows;
4. models with sliding-window layers: each scheduled sequence's local block group gets blocks for
   the positions it computes this step (quill.engine.window_blocks; sized so it cannot run out, so
   admission and preemption count the global group's blocks only).

The step's token budget (``max_num_batched_tokens``) bounds a step's work, so a long
prompt is split into chunks that share steps with the running decodes and never
stalls them for long.
"""

from __future__ import annotations

from collections import deque

from quill.engine.block_manager import BlockManager
from quill.engine.sequence import Sequence, Status


class Scheduler:
    """Waiting queue and running set of an engine; ``schedule()`` plans one step."""

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, speculator=None):
        """``speculator``: a ``quill.engine.speculative.Speculator`` whose drafts decoding sequences run with
        their token (None: no speculation)."""
        self.blocks, self.speculator = blocks, speculator
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, number of its tokens to compute) for this step, in packed order."""
        budget = self.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        for seq in list(self.running):  # decodes: one token each, oldest first
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or seq.in_prefill:
                continue
            if not self._make_room(seq):
                continue
            self.blocks.append_slot(seq)
            batch.append((seq, 1))
            budget -= 1
        # A later decode's room may have preempted one already batched: the newest by arrival need not come last
        # in ``running`` (a readmitted sequence keeps its arrival).  Its blocks are gone: it leaves the step.
        kept = [(seq, n) for seq, n in batch if seq.status is Status.RUNNING]
        budget += len(batch) - len(kept)
        batch = kept
        if self.speculator is not None:
            budget = self._speculate(batch, budget)
        for seq in self.running:  # prefills under way: their next chunk
            if budget and seq.in_prefill:
                n = min(seq.num_tokens - seq.num_computed, budget)
                batch.append((seq, n))
                budget -= n
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.blocks.can_allocate(seq):
                break  # KV memory is full: waiting requests wait
            self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            batch.append((seq, n))
            budget -= n
        for seq, n in batch:  # sliding-window layers: blocks for just the positions computed (never runs out)
            if seq.status is Status.RUNNING:
                self.blocks.cover_window(seq, n)
        return batch

    def _speculate(self, batch: list[tuple[Sequence, int]], budget: int) -> int:
        """Give decoding sequences their drafts, after every decode has its token: a draft's blocks come from
        free ones only (a decode that needed one would otherwise preempt someone), within the budget.  The
        proposer sees every sequence that wants drafts at once (a draft model runs them batched)."""
        if self.speculator.config.adaptive and self._prefill_pending():
            return budget  # a step that carries a prompt chunk is compute-bound: a draft row costs what a token does
        wanted: list[tuple[int, Sequence, int]] = []  # (place in the batch, sequence, k)
        for i, (seq, _) in enumerate(batch):
            if budget == 0:
                break
            k = self.speculator.wants(seq, budget)
            if k:
                wanted.append((i, seq, k))
                budget -= k
        drafts = self.speculator.propose_many([(seq, k) for _, seq, k in wanted], decodes=len(batch))
        for (i, seq, k), d in zip(wanted, drafts):
            seq.drafts = d[:self.blocks.reserve_ahead(seq, len(d))] if d else []
            batch[i] = (seq, 1 + len(seq.drafts))
            budget += k - len(seq.drafts)
        return budget

    def _prefill_pending(self) -> bool:
        """Whether this step will run a prompt chunk: a running sequence's, or a waiting one's that can be admitted."""
        if any(seq.in_prefill for seq in self.running):
            return True
        return (bool(self.waiting) and len(self.running) < self.max_num_seqs
                and self.blocks.can_allocate(self.waiting[0]))

    def _make_room(self, seq: Sequence) -> bool:
        """Preempt the newest running sequences until ``seq`` can grow; False if ``seq`` itself was preempted."""
        while not self.blocks.can_append(seq):
            victim = max(self.running, key=lambda s: s.arrival)
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it first: it recomputes its tokens when readmitted."""
        self.blocks.free_blocks(seq)
        self._release_drafts(seq)
        self.running.remove(seq)
        seq.restart()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Retire ``seq`` (finished or aborted): its blocks go back to the pool at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.blocks.free_blocks(seq)
            self._release_drafts(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    def _release_drafts(self, seq: Sequence) -> None:
        if self.speculator is not None:
            self.speculator.release(seq)
