"""Fields of GGUF quantized blocks, shared by the converters (quants.py, kquants.py).

Blocks arrive as uint8 ``[R, B, type_size]``: R rows of B blocks each.
"""

from __future__ import annotations

import torch


def half_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The f16 field at byte ``start`` of every block: uint8 [R, B, bytes] -> float16 [R, B]."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).squeeze(-1)


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [R, B, 16] -> uint8 [R, B, 32] per block: low nibbles are weights 0..15, high 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def flat(t: torch.Tensor) -> torch.Tensor:
    """[R, B, per-block...] -> [R, B * per-block]."""
    return t.reshape(t.shape[0], -1)
