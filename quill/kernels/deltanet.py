"""The Gated DeltaNet decode update in native code (``_quill_native.deltanet_decode``, csrc/deltanet*).

quill.layers.deltanet calls :func:`decode` for its decode tokens: the conv step, the gated delta rule and
the gated RMSNorm of one new token per sequence in one call, the states updated in place.  It answers
None when the native op cannot run them (no extension, no ISA chosen at load, other than float32), and the
layer runs its torch form.
"""

from __future__ import annotations

import torch

from quill import native


def decode(qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_w: torch.Tensor,
           a_log: torch.Tensor, dt_bias: torch.Tensor, norm_w: torch.Tensor, eps: float,
           conv_state: torch.Tensor, state: torch.Tensor, isa: str | None, tiled: bool = False) -> torch.Tensor | None:
    """qkv [N, C], z [N, Hv Dv], a and b [N, Hv] (this token of N sequences); conv_w [C, K], a_log and dt_bias
    [Hv], norm_w [Dv]; conv_state [N, C, K-1] and state [N, Hv, Dk, Dv] (sequence i's in row i, updated in
    place); tiled: value head h reads key head h % Hk (llama.cpp's order), else h // (Hv / Hk)
    -> rmsnorm(o) * norm_w * silu(z) [N, Hv Dv] float32, or None (the caller runs torch)."""
    ext = native.load().module if isa is not None else None
    tensors = (qkv, z, a, b, conv_w, a_log, dt_bias, norm_w, conv_state, state)
    if ext is None or any(t.dtype != torch.float32 for t in tensors):
        return None
    rows = torch.arange(qkv.shape[0], dtype=torch.int64)
    return ext.deltanet_decode(qkv, z, a.contiguous(), b.contiguous(), conv_w, None, a_log, dt_bias, norm_w, eps,
                               conv_state, state, rows, isa, tiled)
