"""KV cache for a batch of left-padded sequences: what the model tests run ``Model.forward`` with.

Not the engine's cache (that is ``quill.engine.kv_cache``, paged); a plain
``LayerCache`` (``quill.models.base``) to check a model with a cache against
the same model without one, batched and alone.

Sequences of different lengths are left-padded to a common length, so every
row appends its next token at the same cache index.  ``pad[b]`` leading slots
of row b are padding: no real query attends to them, and a row's positions
start at 0 on its first real token (as transformers does with an attention
mask), so each row computes exactly what it would alone.
"""

from __future__ import annotations

import torch

from quill.kernels.fused import window_mask
from quill.layers import attention
from quill.models.base import ForwardContext


class _LayerView:
    """One layer's slice of the cache: appends at the shared write offset."""

    def __init__(self, cache: "KVCache", index: int):
        self.cache, self.index = cache, index

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        start, end = c.length, c.length + k.shape[2]
        c.keys[self.index][:, :, start:end] = k
        c.values[self.index][:, :, start:end] = v
        return c.keys[self.index][:, :, :end], c.values[self.index][:, :, :end]  # [B, Hkv, S, D]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        k, v = self.update(k, v)  # [B, Hkv, S, D]
        if window is not None:  # slots and positions differ by each row's padding only: the band is the same
            S, T = k.shape[2], q.shape[2]
            band = window_mask(torch.arange(S - T, S), S, window)[None, None]  # [1, 1, T, S]
            mask = band if mask is None else mask & band
        return attention(q, k, v, mask, scale, self.cache.isa, sinks)


class KVCache:
    """Per-layer key/value buffers [B, Hkv, capacity, D], grown on demand."""

    def __init__(self, num_layers: int, pad: torch.Tensor, kv_heads: int, head_dim: int,
                 capacity: int, dtype: torch.dtype = torch.float32, isa: str | None = None):
        self.pad = pad.to(torch.int64)  # [B] leading pad slots per row
        self.isa = isa  # the native decode-attention variant (chosen at load), None for torch
        batch = self.pad.shape[0]
        shape = (batch, kv_heads, max(1, capacity), head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.length = 0  # slots written so far (pads included)
        self._views = [_LayerView(self, i) for i in range(num_layers)]

    @property
    def batch(self) -> int:
        return self.pad.shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new = max(needed, 2 * self.capacity)
        for buf in (self.keys, self.values):
            for i, t in enumerate(buf):
                grown = t.new_zeros(t.shape[0], t.shape[1], new, t.shape[3])
                grown[:, :, : self.length] = t[:, :, : self.length]
                buf[i] = grown

    def context(self, num_new: int) -> ForwardContext:
        """The positions and mask for appending ``num_new`` tokens to every row."""
        self._reserve(self.length + num_new)
        total = self.length + num_new
        q_idx = torch.arange(self.length, total)  # [T] cache slot of each new token
        k_idx = torch.arange(total)  # [S]
        positions = (q_idx[None, :] - self.pad[:, None]).clamp_min(0)  # [B, T]
        causal = k_idx[None, :] <= q_idx[:, None]  # [T, S]
        if bool(self.pad.any()):
            real = k_idx[None, :] >= self.pad[:, None]  # [B, S]
            # A pad query sees only itself: never an all-masked row (NaN), and it feeds no real token.
            own = k_idx[None, :] == q_idx[:, None]  # [T, S]
            mask = (causal[None] & (real[:, None, :] | own[None]))[:, None]  # [B, 1, T, S]
        elif num_new == 1:
            mask = None  # one new token with no padding sees every cached key
        else:
            mask = causal[None, None]  # [1, 1, T, S]
        return ForwardContext(positions, mask, self._views)

    def advance(self, num_new: int) -> None:
        """Commit the slots written by the last forward."""
        self.length += num_new

    def keep(self, rows: torch.Tensor) -> None:
        """Drop finished rows, keeping ``rows`` (int64 indices) in that order."""
        self.pad = self.pad[rows]
        for buf in (self.keys, self.values):
            for i, t in enumerate(buf):
                buf[i] = t[rows]
        # Rows that left may have been the only ones without padding: drop columns every row pads.
        trim = int(self.pad.min()) if self.batch else 0
        if trim:
            for buf in (self.keys, self.values):
                for i, t in enumerate(buf):
                    buf[i] = t[:, :, trim:].contiguous()
            self.pad = self.pad - trim
            self.length -= trim

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for buf in (self.keys, self.values) for t in buf)
