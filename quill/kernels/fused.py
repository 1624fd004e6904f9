"""Fused ops of decoder layers: RMSNorm, rotary embedding of q and k, SiLU- and gelu-tanh-and-multiply, decode
attention.

Model layers call these plain functions.  Each has a torch version (the
definition, and the fallback) and a native one (``quill/native/csrc/ops.cpp``):
one call instead of 4-16 small torch ops, whose fixed cost dominates a decode
step outside the linears.  The native version runs when the extension is built
and the inputs are float32/bfloat16/float16 of one dtype; it rounds where torch
rounds, so it matches torch exactly (rope, SiLU-and-multiply up to exp's last
bit) or up to summation order (RMSNorm's mean).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quill import native
from quill.errors import KernelError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _ext():
    return native.load().module  # cached import, None when the extension is not built


def _native_ok(*ts: torch.Tensor) -> bool:
    dt = ts[0].dtype
    return dt in FLOAT_DTYPES and all(t.dtype == dt and not t.requires_grad for t in ts)


# ---- definitions (torch) ------------------------------------------------------------------------

def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, the norm in float32 (transformers' LlamaRMSNorm)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] rotated by cos/sin [B, T, D] (rotate-half layout, as HF checkpoints expect)."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def silu_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def window_mask(q_pos: torch.Tensor, s: int, window: int | None) -> torch.Tensor:
    """bool [n, s]: query at position q_pos[i] may attend key position j (causal; with a sliding window,
    only its last ``window`` positions, its own included: transformers' ``kv > q - window``)."""
    k_pos = torch.arange(s)[None, :]
    seen = k_pos <= q_pos[:, None]
    if window is not None:
        seen &= k_pos > q_pos[:, None] - window
    return seen


def decode_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                           scale: float) -> torch.Tensor:
    """Attention of one query token per sequence, the query heads grouped by KV head (two bmm).

    q [B, H, 1, D], k and v [B, Hkv, S, D], mask bool [B or 1, 1, 1, S] or None -> [B, H, 1, D].
    """
    B, H, _, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    scores = torch.bmm(q.reshape(B * Hkv, G, D), k.flatten(0, 1).transpose(1, 2))  # [B*Hkv, G, S]
    scores.mul_(scale)
    if mask is not None:
        scores = scores.view(B, Hkv, G, S).masked_fill(~mask, float("-inf")).view(B * Hkv, G, S)
    return torch.bmm(torch.softmax(scores, dim=-1), v.flatten(0, 1)).view(B, H, 1, D)


def sink_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax denominator also holds one learned logit per query head (gpt-oss's
    attention sinks): ``softmax([q.k * scale, sink])`` with the sink's column dropped, so a head may put
    weight on nothing.  transformers' eager gpt-oss attention computes the same.

    q [B, H, T, D], k and v [B, Hkv, S, D], mask bool broadcastable to [B, 1, T, S] (True = may attend) or
    None, sinks [H] -> [B, H, T, D] in q's dtype (scores and softmax in float32).
    """
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if sinks.shape != (H,):
        raise KernelError(f"attention sinks: expected one per query head [{H}], found {list(sinks.shape)}")
    G = H // Hkv
    qg = q.float().reshape(B, Hkv, G * T, D)  # the G query heads sharing a KV head, their T rows stacked
    scores = torch.matmul(qg, k.float().transpose(-1, -2)).mul_(scale).view(B, H, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, H, 1, 1).expand(B, H, T, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :S]  # a row all masked still sums < 1
    out = torch.matmul(probs.reshape(B, Hkv, G * T, S), v.float())  # [B, Hkv, G*T, D]
    return out.view(B, H, T, D).to(q.dtype)


# ---- what layers call ---------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x [..., D] with weight [D]."""
    ext = _ext()
    if ext is not None and _native_ok(x, weight):
        return ext.rms_norm(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, Hq, D] and k [B, T, Hk, D] rotated by cos/sin [B, T, D]; may overwrite q and k."""
    ext = _ext()
    if ext is not None and _native_ok(q, k, cos, sin) and cos.shape[0] == q.shape[0]:
        q, k = q.contiguous(), k.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        ext.rope_(q, cos, sin)
        ext.rope_(k, cos, sin)
        return q, k
    return rope_torch(q, cos, sin), rope_torch(k, cos, sin)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] rotated by cos/sin [B, T, D] (a query without keys: Gemma 4's KV-shared layers); may
    overwrite x."""
    ext = _ext()
    if ext is not None and _native_ok(x, cos, sin) and cos.shape[0] == x.shape[0]:
        x = x.contiguous()
        ext.rope_(x, cos.contiguous(), sin.contiguous())
        return x
    return rope_torch(x, cos, sin)


_ONES: dict = {}


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight over the last dimension of x [..., D]: :func:`rms_norm` with a weight of ones
    (exact: 1 * v), the native op the native decode step runs (Gemma 4's value norm)."""
    key = (x.shape[-1], x.dtype)
    if key not in _ONES:
        _ONES[key] = torch.ones(x.shape[-1], dtype=x.dtype)
    return rms_norm(x, _ONES[key], eps)


def _sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """Attention sinks as the native kernels take them: float32 [H], contiguous (None: no sinks)."""
    return None if sinks is None else sinks.float().contiguous()


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, isa: str | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per sequence against its cache (decode), grouped KV heads.

    q [B, H, 1, D], k and v [B, Hkv, S, D], mask bool [B or 1, 1, 1, S] or None -> [B, H, 1, D].
    ``isa``: the native variant chosen at load (``quill.native.isa_for``), None for torch.
    Native (float32): each K and V row read once per KV head, where ATen's flash kernel took
    2-4x longer on single query tokens.  ``sinks`` [H]: attention sinks (:func:`sink_attention_torch`).
    """
    ext = _ext() if isa is not None else None
    if ext is not None and _native_ok(q, k, v) and q.dtype == torch.float32:
        return ext.decode_attention(q, k, v, mask, scale, isa, _sinks(sinks))
    if sinks is not None:
        return sink_attention_torch(q, k, v, mask, scale, sinks)
    return decode_attention_torch(q, k, v, mask, scale)


KV_POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the native paged kernels read


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                           lens: torch.Tensor, scale: float, isa: str | None = None,
                           window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention read through a paged pool's slot tables, without gathering the context.

    q [B, H, 1, D]; k_pool and v_pool [N, Hkv, D]; slots int64 [B, Smax] (the pool rows of each
    sequence's context, in order, padded past its length); lens int64 [B] -> [B, H, 1, D].  The
    native kernel (``isa`` as chosen at load; None for torch) returns the bits
    :func:`decode_attention` gives on the gathered, masked rows (float32; bfloat16 and float16 pools
    are widened exactly as read, q enters as float32 and the result is rounded to q's dtype).
    ``window``: a local layer's sliding window, each sequence attends its last ``window`` positions
    (the new token's included, as transformers counts); None: all.  ``sinks`` [H]: one learned logit per
    head in the softmax denominator (:func:`sink_attention_torch`; the native kernel folds it into its max
    and sum).
    """
    ext = _ext() if isa is not None else None
    if (ext is not None and q.dtype in (torch.float32, torch.bfloat16) and k_pool.dtype in KV_POOL_DTYPES
            and not q.requires_grad):
        return ext.paged_decode_attention(q.float(), k_pool, v_pool, slots, lens, scale, isa, window or 0,
                                          _sinks(sinks)).to(q.dtype)
    kd = k_pool[slots].permute(0, 2, 1, 3)  # [B, Hkv, Smax, D]
    vd = v_pool[slots].permute(0, 2, 1, 3)
    mask = None
    pos = torch.arange(slots.shape[1])[None, :]
    if window is not None:
        mask = ((pos < lens[:, None]) & (pos >= lens[:, None] - window))[:, None, None, :]
    elif bool((lens != slots.shape[1]).any()):
        mask = (pos < lens[:, None])[:, None, None, :]  # [B, 1, 1, Smax]
    if sinks is not None:
        if mask is None:
            mask = torch.ones(1, 1, 1, slots.shape[1], dtype=torch.bool)
        return sink_attention_torch(q, kd, vd, mask, scale, sinks)
    return decode_attention_torch(q, kd.to(q.dtype), vd.to(q.dtype), mask, scale)


def paged_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, ctx: torch.Tensor,
                            scale: float, isa: str | None = None, window: int | None = None,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a chunk of one sequence's new tokens through its paged pool's slot table.

    q [n, H, D] (token-major); k_pool and v_pool [N, Hkv, D]; ctx int64 [S], S >= n (the pool rows of
    the whole context, the chunk its last n positions) -> [n, H, D]: token i attends positions
    0 .. S - n + i.  The native kernel (``isa`` as chosen at load; None for torch) streams key blocks
    past blocks of query rows (csrc/prefill.h) and writes token-major; torch gathers the context
    and runs ATen's flash attention.  16-bit pools (a float16 / bfloat16 KV cache) are widened exactly
    as read, attention computing in float32 as with float32 pools holding the same values.
    ``window``: a local layer's sliding window, token i attends only the last ``window`` of those
    positions; None: all.  ``sinks`` [H]: as :func:`paged_decode_attention` (the native kernel starts each
    row's running max at its head's sink and its sum at exp(0)).
    """
    ext = _ext() if isa is not None else None
    if (ext is not None and q.dtype == torch.float32 and k_pool.dtype in KV_POOL_DTYPES
            and v_pool.dtype == k_pool.dtype and not q.requires_grad):
        return ext.paged_prefill_attention(q.contiguous(), k_pool, v_pool, ctx, scale, isa, window or 0,
                                           _sinks(sinks))
    n, s = q.shape[0], ctx.numel()
    kc = k_pool[ctx].permute(1, 0, 2)[None].to(q.dtype)  # [1, Hkv, S, D]
    vc = v_pool[ctx].permute(1, 0, 2)[None].to(q.dtype)
    causal = window_mask(torch.arange(s - n, s), s, window)  # [n, S]
    qc = q.transpose(0, 1)[None]  # [1, H, n, D]
    if sinks is not None:
        return sink_attention_torch(qc, kc, vc, causal[None, None], scale, sinks)[0].transpose(0, 1)
    out = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=causal[None, None], scale=scale,
                                         enable_gqa=qc.shape[1] != kc.shape[1])
    return out[0].transpose(0, 1)  # [n, H, D]


def gelu_tanh_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) (tanh approximation, transformers' gelu_pytorch_tanh) * up: Gemma's gated MLP."""
    ext = _ext()
    if ext is not None and _native_ok(gate, up) and gate.shape == up.shape:
        return ext.gelu_tanh_mul(gate, up)
    return gelu_tanh_mul_torch(gate, up)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), element-wise (Qwen3.5's attention output gate, a shared expert's gate): the native
    op the native decode step runs, so both paths give one result."""
    ext = _ext()
    if ext is not None and _native_ok(x):
        return ext.sigmoid(x)
    return torch.sigmoid(x)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, element-wise (the gated MLP's activation)."""
    ext = _ext()
    if ext is not None and _native_ok(gate, up) and gate.shape == up.shape:
        return ext.silu_mul(gate, up)
    return silu_mul_torch(gate, up)
