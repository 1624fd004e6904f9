"""The paged KV cache: one preallocated pool of blocks per layer, read and written through block tables.

A step packs every scheduled sequence's new tokens into one row (no padding):
prefill chunks and single decode tokens side by side.  ``StepLayout`` says where
each sequence's tokens sit in that row, which pool slots they are written to, and
which slots hold each sequence's whole context.  Attention then runs per kind:
every decode token at once (the paged decode-attention kernel, reading each
sequence's keys and values in the pool through its slot table), and each prefill
chunk over its cached prefix plus itself, causally.

Which kernel attends a token depends only on what the token is, never on how the step was
scheduled: a prompt token goes through prefill attention (even alone in its chunk: the last
token of a chunked prompt, or the one left after a prefix-cache hit), a generated token fed back
through decode attention (even when a preempted sequence recomputes it inside a chunk).  The two
kernels round differently, so this keeps greedy output the same however the prompt was chunked,
cached or preempted.

A model with sliding-window layers keeps those layers' pools in a block group of their own
(``local_layers``, ``local_blocks``; quill.engine.window_blocks): a step then has a second layout over
each sequence's local block table (``StepLayout.local``), the same positions in that group's rows, and
the local layers read and write through it.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch

from quill.errors import GenerationError
from quill.layers import paged_decode_attention, paged_prefill_attention


@dataclass
class StepLayout:
    """Where one step's packed tokens go (shared by every layer of the step)."""

    slots: torch.Tensor  # int64 [T]: pool slot written by each new token
    decode_rows: torch.Tensor  # int64 [Bd]: positions in the packed row of the decode tokens
    decode_slots: torch.Tensor  # int64 [Bd, Smax]: context slots of each decoding sequence (0-padded)
    decode_lens: torch.Tensor  # int64 [Bd]: context length of each decoding sequence
    prefills: list[tuple[int, int, torch.Tensor]]  # (start in the row, new tokens, context slots int64 [S])
    # the same step in the sliding-window layers' block group (their tables), None: no such group
    local: "StepLayout | None" = None

    @classmethod
    def build(cls, pieces: list[tuple[list[int], int, int, int]], block_size: int) -> "StepLayout":
        """``pieces``: per sequence (block table, tokens already computed, new tokens, prompt length), in
        packed order.  The new tokens at positions below the prompt length form a prefill chunk; each one
        at or past it (a generated token) is a decode row with its own context length.

        The decode rows' slot tables are formed all at once (a handful of torch ops per step, not per
        sequence: 16 decoding sequences took ~0.4 ms a step one by one)."""
        if all(new == 1 and done >= prompt for _, done, new, prompt in pieces):
            return cls._all_decodes(pieces, block_size)
        offsets = torch.arange(block_size, dtype=torch.int64)
        slots, dec_rows, dec, prefills, row = [], [], [], [], 0
        for table, done, new, prompt in pieces:
            slots += [table[p // block_size] * block_size + p % block_size for p in range(done, done + new)]
            n_prompt = max(0, min(done + new, prompt) - done)  # the chunk's prompt tokens come first
            if n_prompt:
                ctx = _slots(torch.tensor(table, dtype=torch.int64), offsets)[:done + n_prompt]
                prefills.append((row, n_prompt, ctx))
            for i in range(n_prompt, new):  # generated tokens: decode rows, each seeing positions 0 .. done + i
                dec_rows.append(row + i)
                dec.append((table, done + i))
            row += new
        ctx, lens = _decode_slots(dec, offsets)
        return cls(torch.tensor(slots, dtype=torch.int64), torch.tensor(dec_rows, dtype=torch.int64), ctx, lens,
                   prefills)

    @classmethod
    def _all_decodes(cls, pieces: list[tuple[list[int], int, int, int]], block_size: int) -> "StepLayout":
        """The layout of a step whose every sequence decodes one token (the common step), in numpy:
        the same tensors as the general path, in ~15 us instead of ~80 (a few tiny torch ops cost
        more than the default model's whole step spends outside its kernels)."""
        n = len(pieces)
        lens = np.fromiter((done + 1 for _, done, _, _ in pieces), dtype=np.int64, count=n)
        longest = int(lens.max())
        blocks = -(-longest // block_size)
        tables = np.zeros((n, blocks), dtype=np.int64)
        for i, (table, _, _, _) in enumerate(pieces):
            row = table[:blocks]
            tables[i, :len(row)] = row
        ctx = (tables[:, :, None] * block_size + np.arange(block_size, dtype=np.int64)).reshape(n, -1)[:, :longest]
        ctx = np.where(np.arange(longest) < lens[:, None], ctx, 0)  # a new C-contiguous array
        new_slots = ctx[np.arange(n), lens - 1]
        return cls(torch.from_numpy(new_slots), torch.arange(n, dtype=torch.int64), torch.from_numpy(ctx),
                   torch.from_numpy(lens), [])

    def one_row_per_sequence(self, num_sequences: int) -> bool:
        """Every row a decode and no sequence with two (what the native decode step runs)."""
        return not self.prefills and self.decode_rows.numel() == num_sequences

    def all_decodes(self) -> bool:
        """Every row a decode, a sequence possibly with several (speculative drafts): the native decode step
        runs these too, for a model without recurrent state -- it stores every row's keys and values before
        any row attends, and each row reads its own context length."""
        return not self.prefills and self.decode_rows.numel() == self.slots.numel()


def _slots(table: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Block table int64 [..., B] -> the slot of every position its blocks hold, int64 [..., B * block_size]."""
    return (table.unsqueeze(-1) * offsets.numel() + offsets).flatten(-2)


def _decode_slots(rows: list[tuple[list[int], int]], offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode rows (block table, position) -> context slots int64 [Bd, longest] (0-padded) and context
    lengths int64 [Bd] (position + 1: the row's own token included)."""
    if not rows:
        return torch.empty(0, 0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    lens = torch.tensor([pos + 1 for _, pos in rows], dtype=torch.int64)
    longest = int(lens.max())
    blocks = -(-longest // offsets.numel())
    tables = torch.tensor([t[:blocks] + [0] * (blocks - len(t[:blocks])) for t, _ in rows], dtype=torch.int64)
    ctx = _slots(tables, offsets)[:, :longest]
    return ctx.masked_fill(torch.arange(longest) >= lens.unsqueeze(1), 0), lens


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros that cost nothing until written: an anonymous mapping, whose pages the kernel supplies
    zero-filled on first touch.  A pool sized for many long contexts then takes neither start-up time
    (torch.zeros wrote 4.6 GB in 1.5 s for the default model's default pool) nor resident memory
    beyond the blocks in use."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)  # the tensor keeps the map alive


def to_pool(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a pool of ``dtype`` stores it: rounded to nearest even; for float16, saturated to +-65504 first
    (a value past its range would become inf and every later attention output NaN), as the native
    step stores (csrc/attention_tile.h store_kv)."""
    if dtype == torch.float16:
        x = x.clamp(-65504.0, 65504.0)  # NaN stays NaN
    return x.to(dtype)


class PagedKVCache:
    """Per layer, keys and values for ``num_blocks * block_size`` token slots: [slots, Hkv, D]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, isa: str | None = None, kv_layers: list[bool] | None = None,
                 layer_shapes: list[tuple[int, int] | None] | None = None, local_layers: frozenset[int] = frozenset(),
                 local_blocks: int = 0):
        """``kv_layers``: which layers keep keys and values (None: all); the others (recurrent layers) get
        empty pools, so the lists stay indexed by decoder layer.  ``layer_shapes``: per layer its own (kv heads,
        head dim), or None for a layer without a pool (Gemma 4: global layers wider than local ones, and
        layers that read another layer's pool); it overrides ``kv_heads``, ``head_dim`` and ``kv_layers``.
        ``local_layers``: the layers whose pools hold ``local_blocks`` blocks instead (the sliding-window block
        group, its null block included), read and written through ``StepLayout.local``."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.local_layers, self.local_blocks = frozenset(local_layers), local_blocks
        self.isa = isa  # the native variant decode attention runs (chosen at load), None for torch
        if layer_shapes is None:
            kv = kv_layers or [True] * num_layers
            layer_shapes = [(kv_heads, head_dim) if kv[i] else None for i in range(num_layers)]
        rows = [(local_blocks if i in self.local_layers else num_blocks) * block_size for i in range(num_layers)]
        shapes = [(rows[i], *s) if s is not None else (0, kv_heads, head_dim) for i, s in enumerate(layer_shapes)]
        self.keys = [untouched_zeros(shape, dtype) for shape in shapes]
        self.values = [untouched_zeros(shape, dtype) for shape in shapes]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                        layer_shapes: list[tuple[int, int] | None] | None = None) -> int:
        per_token = num_layers * kv_heads * head_dim if layer_shapes is None else (
            sum(h * d for h, d in filter(None, layer_shapes)))
        return 2 * per_token * block_size * torch.empty(0, dtype=dtype).element_size()

    def views(self, layout: StepLayout) -> list["PagedLayerCache"]:
        if self.local_layers and layout.local is None:
            raise GenerationError("the sliding-window layers' pools are a block group of their own: the step's "
                                  "layout needs its local part (StepLayout.local)")
        return [PagedLayerCache(self.keys[i], self.values[i], layout.local if i in self.local_layers else layout,
                                self.isa) for i in range(len(self.keys))]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for buf in (self.keys, self.values) for t in buf)


class PagedLayerCache:
    """One layer's pool seen through one step's layout (``quill.models.base.LayerCache``)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, layout: StepLayout, isa: str | None = None):
        self.keys, self.values, self.layout, self.isa = keys, values, layout, isa

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [1, H, T, D], k and v [1, Hkv, T, D] (the packed new tokens, or None: attend what the pool holds,
        the step's tokens written by the layer that owns it) -> [1, H, T, D]; ``window``: a
        local layer's sliding window (the pool keeps every position; attention reads the last ``window``);
        ``sinks`` [H]: attention sinks, one learned logit per head in the softmax denominator (gpt-oss)."""
        lay = self.layout
        if k is not None:  # None: a layer reading another layer's pool (Gemma 4's KV-shared layers) writes nothing
            self.keys.index_copy_(0, lay.slots, to_pool(k[0].transpose(0, 1), self.keys.dtype))  # [T, Hkv, D]
            self.values.index_copy_(0, lay.slots, to_pool(v[0].transpose(0, 1), self.values.dtype))
        if not lay.prefills:  # every token a decode (most steps): no gather, no scatter
            qd = q[0].transpose(0, 1)[:, :, None]  # [T, H, 1, D]
            od = paged_decode_attention(qd, self.keys, self.values, lay.decode_slots, lay.decode_lens, scale,
                                        self.isa, window, sinks)
            return od[:, :, 0].transpose(0, 1)[None]  # [1, H, T, D]
        # token-major [T, H, D]: the model's transpose back to [T, H * D] is then free
        out = torch.empty(q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype)
        qt = q[0].transpose(0, 1)  # [T, H, D]
        if lay.decode_rows.numel():
            qd = qt[lay.decode_rows][:, :, None]  # [Bd, H, 1, D]
            od = paged_decode_attention(qd, self.keys, self.values, lay.decode_slots, lay.decode_lens,
                                        scale, self.isa, window, sinks)  # [Bd, H, 1, D]
            out[lay.decode_rows] = od[:, :, 0]
        for start, n, ctx in lay.prefills:
            out[start:start + n] = paged_prefill_attention(qt[start:start + n], self.keys, self.values, ctx, scale,
                                                           self.isa, window, sinks)
        return out.transpose(0, 1)[None]  # [1, H, T, D]
