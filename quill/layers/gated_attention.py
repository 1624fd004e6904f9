"""What Qwen3.5's full-attention layers add to rotary attention: zero-centred norms, partial rotary,
and a sigmoid gate on the attention output (transformers' ``Qwen3_5Attention`` / ``Qwen3_5RMSNorm``)."""

from __future__ import annotations

import torch

from quill.layers.context import LoadContext
from quill.layers.rope import apply_rope_qk
from quill.layers.slots import RMSNorm, checked


class OffsetRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint stores ``weight - 1`` (zero-centred: ``x_hat * (1 + w)``).

    The slot holds ``1 + w``, so what runs (here and in native code) is a plain RMSNorm."""

    def load_tensor(self, name: str, attr: str, tensor: torch.Tensor, ctx: LoadContext) -> bool:
        if attr != "weight":
            return False
        w = checked(ctx, f"{name}.weight", tensor, (self.dim,)).float()
        self.weight = (1.0 + w).to(ctx.dtype)  # as transformers: (1 + w) in float32
        return True


def apply_partial_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, H, D], k [B, T, Hk, D]: the first ``cos.shape[-1]`` channels of each head rotated, the rest
    passed through (``partial_rotary_factor``)."""
    rd = cos.shape[-1]
    if rd == q.shape[-1]:
        return apply_rope_qk(q, k, cos, sin)
    qr, kr = apply_rope_qk(q[..., :rd].contiguous(), k[..., :rd].contiguous(), cos, sin)
    return torch.cat([qr, q[..., rd:]], dim=-1), torch.cat([kr, k[..., rd:]], dim=-1)
