"""Per-sequence recurrent state beside the paged KV cache (hybrid models: Qwen3.5's Gated DeltaNet layers).

The model describes, per decoder layer, the state one sequence keeps there (``state_specs()``: shapes and
dtype, None for a layer that uses the KV cache); the engine knows nothing else about it.  Every running
sequence owns one *slot*: its state in every recurrent layer, preallocated for ``max_num_seqs`` sequences
out of the same memory budget as the KV blocks.  A slot is zeroed when a sequence is admitted (a preempted
sequence starts again from zero and recomputes its tokens) and freed when it finishes, aborts or is
preempted.  A step's new states are kept only once the whole forward succeeded (``commit``), so a step
that fails and is retried request by request starts from the same states.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from quill.errors import GenerationError
from quill.layers.deltanet import StateSpec


def state_bytes(specs: Seq[StateSpec | None]) -> int:
    """Bytes of one sequence's state in every layer."""
    return sum(s.nbytes() for s in specs if s is not None)


class StatePool:
    """``num_slots`` sequences' states: per recurrent layer, one tensor [num_slots, *shape] per state part."""

    def __init__(self, specs: Seq[StateSpec | None], num_slots: int):
        self.specs = list(specs)
        self.num_slots = num_slots
        self.pools: dict[int, list[torch.Tensor]] = {
            i: [torch.zeros(num_slots, *shape, dtype=s.dtype) for shape in s.shapes]
            for i, s in enumerate(self.specs) if s is not None}
        self.free = list(range(num_slots - 1, -1, -1))  # pop() takes the lowest slot first
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self.free)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.pools.values() for t in ts)

    def take(self, request_id: str) -> int:
        """A zeroed slot for a newly admitted sequence."""
        if not self.free:
            raise GenerationError(f"request {request_id}: no recurrent-state slot free ({self.num_slots} in all)")
        slot = self.free.pop()
        for ts in self.pools.values():
            for t in ts:
                t[slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def views(self, caches: list, slots: list[int], segments: list[tuple[int, int]]) -> list:
        """``caches`` (the KV cache's per-layer views) with each recurrent layer's entry replaced by its
        :class:`LayerStateView` over the step's sequences (their ``slots``, ``segments`` of the packed row)."""
        index = torch.tensor(slots, dtype=torch.int64)
        out = list(caches)
        for i, pools in self.pools.items():
            out[i] = LayerStateView(self, pools, index, segments)
        return out

    def stage(self, pool: torch.Tensor, index: torch.Tensor, value: torch.Tensor) -> None:
        self._pending.append((pool, index, value))

    def commit(self) -> None:
        """Keep the states the step's forward wrote (called once it returned)."""
        for pool, index, value in self._pending:
            pool.index_copy_(0, index, value.to(pool.dtype))
        self._pending = []

    def discard(self) -> None:
        self._pending = []


class LayerStateView:
    """One recurrent layer's states for one step (``quill.layers.deltanet.StateView``)."""

    def __init__(self, pool: StatePool, tensors: list[torch.Tensor], slots: torch.Tensor,
                 segments: list[tuple[int, int]]):
        self.pool, self.tensors, self.slots, self.segments = pool, tensors, slots, segments

    def read(self, seqs: list[int]) -> list[torch.Tensor]:
        index = self.slots[seqs]
        return [t.index_select(0, index) for t in self.tensors]

    def write(self, seqs: list[int], states: list[torch.Tensor]) -> None:
        if len(states) != len(self.tensors):
            raise GenerationError(f"a recurrent layer wrote {len(states)} state tensors, its description has "
                                  f"{len(self.tensors)}")
        index = self.slots[seqs]
        for t, s in zip(self.tensors, states):
            if tuple(s.shape[1:]) != tuple(t.shape[1:]):
                raise GenerationError(f"recurrent state of shape {list(s.shape[1:])} does not match the "
                                      f"described {list(t.shape[1:])}")
            self.pool.stage(t, index, s)
