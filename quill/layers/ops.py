"""The fused ops and attention model files call (their native / torch choice lives in quill.kernels.fused)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quill.kernels import fused
from quill.kernels.fused import (
    sigmoid,  # noqa: F401  (models gate through quill.layers)
    unit_rms_norm,  # noqa: F401  (a weightless RMSNorm: Gemma 4's values)
)

# hidden_act -> fused activation-and-multiply of a gated MLP
ACTIVATIONS = {"silu": fused.silu_mul, "gelu_pytorch_tanh": fused.gelu_tanh_mul}

# decode and prefill attention through a paged KV pool's slot tables (the engine's cache calls them)
paged_decode_attention = fused.paged_decode_attention
paged_prefill_attention = fused.paged_prefill_attention


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float, isa: str | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads.

    q [B, H, T, D], k and v [B, Hkv, S, D] (H a multiple of Hkv), mask bool broadcastable to
    [B, 1, T, S] (True = may attend) or None -> [B, H, T, D].  One query token per sequence
    (decode) goes through :func:`quill.kernels.fused.decode_attention` (native with the ``isa``
    a cache was given at load, else torch); prompts through ATen's flash kernel.  ``sinks`` [H]: one
    learned logit per head in the softmax denominator (gpt-oss): decode as above, prompts in torch
    (:func:`quill.kernels.fused.sink_attention_torch`; ATen's kernel has no sinks).
    """
    if q.shape[2] == 1:
        return fused.decode_attention(q, k, v, mask, scale, isa, sinks)
    if sinks is not None:
        return fused.sink_attention_torch(q, k, v, mask, scale, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, mask: torch.Tensor | None,
           scale: float, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the new tokens, through the layer's KV cache when there is one.

    q [B, H, T, D], k and v [B, Hkv, T, D] (the new tokens' keys and values) -> [B, H, T, D].
    A cache (``quill.models.base.LayerCache``) stores k and v and attends over everything it
    holds for each sequence; without one the new tokens attend to themselves under ``mask``.
    ``window``: a local layer's sliding window (each token attends its last ``window`` positions,
    its own included); None: a global layer.  ``sinks`` [H]: attention sinks (:func:`attention`).
    """
    if cache is None:
        if window is not None:
            T = q.shape[2]
            band = fused.window_mask(torch.arange(T), T, window)[None, None]  # [1, 1, T, T]
            mask = band if mask is None else mask & band
        return attention(q, k, v, mask, scale, sinks=sinks)
    if sinks is not None:  # only models with sinks ask a cache for them
        return cache.attend(q, k, v, mask, scale, window=window, sinks=sinks)
    if window is None:  # global layers call caches that know no windows the way they always did
        return cache.attend(q, k, v, mask, scale)
    return cache.attend(q, k, v, mask, scale, window=window)
