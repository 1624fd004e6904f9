"""Round-to-nearest quantization of float weights into the canonical form.

Not a calibration tool: it makes synthetic quantized weights for tests and
benchmarks (and the inverse direction of every reader's round-trip test).
"""

from __future__ import annotations

import torch

from quill.canonical import QuantizedWeight
from quill.errors import ConfigError


def quantize_rtn(
    w: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    symmetric: bool = True,
    act_order: bool = False,
    offsets: bool = False,
    generator: torch.Generator | None = None,
    scale_dtype: torch.dtype = torch.float16,
) -> QuantizedWeight:
    """Quantize float ``w`` [out, in] with round-to-nearest.

    ``group_size=-1`` is per-channel.  ``act_order=True`` assigns columns to
    groups through a random permutation (as GPTQ's desc_act does), producing a
    ``g_idx``.  ``offsets=True`` produces GGUF Q4_1-style codes with a float
    minimum instead of an integer zero point.
    """
    out, inp = w.shape
    gs = inp if group_size in (-1, 0) else group_size
    if inp % gs:
        raise ConfigError(f"group_size {group_size} does not divide in_features {inp}")
    perm = torch.randperm(inp, generator=generator) if act_order else torch.arange(inp)
    g_idx = torch.empty(inp, dtype=torch.int32)
    g_idx[perm] = (torch.arange(inp) // gs).to(torch.int32)
    wg = w.float()[:, perm].reshape(out, inp // gs, gs)  # columns of each group together
    qmax = (1 << bits) - 1
    zeros = offs = None
    if symmetric and not offsets:
        amax = wg.abs().amax(-1)
        scales = (amax / ((1 << (bits - 1)) - 0.5)).clamp_min(1e-8).to(scale_dtype)
        s = scales.float().unsqueeze(-1)
        q = (torch.round(wg / s) + (1 << (bits - 1))).clamp(0, qmax)
    else:
        lo, hi = wg.amin(-1).clamp_max(0), wg.amax(-1).clamp_min(0)
        scales = ((hi - lo) / qmax).clamp_min(1e-8).to(scale_dtype)
        s = scales.float().unsqueeze(-1)
        if offsets:
            offs = lo.to(scale_dtype)
            q = torch.round((wg - offs.float().unsqueeze(-1)) / s).clamp(0, qmax)
            zeros = torch.zeros(out, inp // gs, dtype=torch.int16)
        else:
            z = torch.round(-lo / s.squeeze(-1)).clamp(0, qmax)
            q = (torch.round(wg / s) + z.unsqueeze(-1)).clamp(0, qmax)
            zeros = z.to(torch.int16)
    codes = torch.empty(out, inp, dtype=torch.uint8)
    codes[:, perm] = q.reshape(out, inp).to(torch.uint8)
    return QuantizedWeight(
        codes=codes, bits=bits, group_size=gs, scales=scales.contiguous(), zeros=zeros,
        offsets=offs, g_idx=g_idx if act_order else None, dtype=w.dtype if w.is_floating_point() else torch.float32,
    ).validate()
