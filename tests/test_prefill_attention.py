"""Paged prefill attention (quill.kernels.fused.paged_prefill_attention, csrc/prefill.h): a chunk of new
tokens attending causally to its whole context through a slot table gives, on every ISA variant, the
scalar twin's bits; it agrees with float64 attention and with the torch fallback; bad inputs are refused
before any read."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quill import native
from quill.errors import KernelError
from quill.kernels import fused
from quill.platform import detect

EXT = native.load().module
PLATFORM = detect()
ISAS = ["scalar"] + [name for name, flags in reversed(native.ISAS) if PLATFORM.has(*flags)]
BEST = native.isa_for(PLATFORM) or "scalar"

pytestmark = pytest.mark.skipif(EXT is None, reason="native kernels not built")


def _case(n, start, h, hkv, d, seed=0):
    """A pool of scattered rows, the context's slot table (start earlier positions, then the chunk) and
    the chunk's queries [n, H, D]."""
    g = torch.Generator().manual_seed(seed)
    rows = start + n + 37
    k_pool = torch.randn(rows, hkv, d, generator=g) * 2  # [N, Hkv, D]
    v_pool = torch.randn(rows, hkv, d, generator=g)
    ctx = torch.randperm(rows, generator=g)[:start + n]  # [S]
    return torch.randn(n, h, d, generator=g), k_pool, v_pool, ctx


def _reference(q, k_pool, v_pool, ctx, scale):
    """float64 attention on the gathered context, token i seeing positions <= start + i."""
    n, s = q.shape[0], ctx.numel()
    kc = k_pool[ctx].permute(1, 0, 2)[None].double()
    vc = v_pool[ctx].permute(1, 0, 2)[None].double()
    causal = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]
    qc = q.double().transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=causal[None, None], scale=scale,
                                         enable_gqa=q.shape[1] != k_pool.shape[1])
    return out[0].transpose(0, 1)


CASES = [  # chunk tokens, positions before it, H, Hkv, D
    (1, 0, 9, 3, 64),        # a one-token prompt
    (37, 0, 9, 3, 64),       # SmolLM2-135M heads, one key block
    (128, 0, 32, 8, 64),     # Llama-3.2-1B heads, two key blocks, a full row block
    (70, 130, 32, 8, 64),    # a later chunk: 200 positions, blocks cut mid-way
    (65, 63, 4, 4, 128),     # no grouping, D = 128, a block edge on each side
    (23, 41, 32, 4, 128),    # eight query heads a KV head (Qwen3-MoE)
    (19, 5, 6, 2, 80),       # a head size padded to the accumulator width
    (9, 0, 3, 1, 40),
]


@pytest.mark.parametrize("n,start,h,hkv,d", CASES)
def test_every_variant_is_the_scalar_twin_and_attention(n, start, h, hkv, d):
    q, kp, vp, ctx = _case(n, start, h, hkv, d, seed=n + start)
    scale = d ** -0.5
    twin = EXT.paged_prefill_attention(q, kp, vp, ctx, scale, "scalar")
    assert twin.shape == (n, h, d) and twin.dtype == torch.float32
    for isa in ISAS[1:]:
        assert torch.equal(EXT.paged_prefill_attention(q, kp, vp, ctx, scale, isa), twin), isa
    torch.testing.assert_close(twin.double(), _reference(q, kp, vp, ctx, scale), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,start,h,hkv,d", CASES)
def test_16_bit_pools_read_as_their_float32_values(n, start, h, hkv, d, pool_dtype):
    """A 16-bit KV cache's pools are widened exactly block by block: a float32 pool's bits, every variant."""
    q, kp, vp, ctx = _case(n, start, h, hkv, d, seed=n + start + 1)
    kh, vh = kp.to(pool_dtype), vp.to(pool_dtype)
    want = EXT.paged_prefill_attention(q, kh.float(), vh.float(), ctx, d ** -0.5, "scalar")
    for isa in ISAS:
        assert torch.equal(EXT.paged_prefill_attention(q, kh, vh, ctx, d ** -0.5, isa), want), isa
    assert torch.equal(fused.paged_prefill_attention(q, kh, vh, ctx, d ** -0.5, BEST), want)
    torch.testing.assert_close(fused.paged_prefill_attention(q, kh, vh, ctx, d ** -0.5, None), want,
                               rtol=1e-5, atol=5e-6)  # torch widens the gathered rows: the same values


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_and_the_torch_fallback_agree(threads):
    q, kp, vp, ctx = _case(100, 28, 32, 8, 64, seed=3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = fused.paged_prefill_attention(q, kp, vp, ctx, 0.125, BEST)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, EXT.paged_prefill_attention(q, kp, vp, ctx, 0.125, "scalar"))
    torch.testing.assert_close(fused.paged_prefill_attention(q, kp, vp, ctx, 0.125, None), got,
                               rtol=1e-5, atol=2e-6)


def test_bad_inputs_raise_kernel_error():
    q, kp, vp, ctx = _case(10, 6, 4, 2, 16)
    bad = ctx.clone()
    bad[3] = kp.shape[0]
    with pytest.raises(KernelError, match=r"prefill_attention: position 3 names pool row \d+; the pool has"):
        EXT.paged_prefill_attention(q, kp, vp, bad, 1.0, BEST)
    with pytest.raises(KernelError, match=r"'ctx' should be int64 \[S\], S >= 10"):
        EXT.paged_prefill_attention(q, kp, vp, ctx[:9], 1.0, BEST)
    with pytest.raises(KernelError, match=r"'v' pool .* does not match 'k' pool"):
        EXT.paged_prefill_attention(q, kp, vp[:-1], ctx, 1.0, BEST)
    with pytest.raises(KernelError, match=r"'v' pool .*BFloat16.* does not match 'k' pool float"):
        EXT.paged_prefill_attention(q, kp, vp.bfloat16(), ctx, 1.0, BEST)
    with pytest.raises(KernelError, match=r"'k' pool should be contiguous float32, bfloat16 or float16 \[N, Hkv, 16\]"):
        EXT.paged_prefill_attention(q, kp.double(), vp, ctx, 1.0, BEST)
    with pytest.raises(KernelError, match=r"4 query heads are not a multiple of 3 KV heads"):
        EXT.paged_prefill_attention(q, kp[:, :1].expand(-1, 3, -1).contiguous(), vp[:, :1].expand(-1, 3, -1)
                                    .contiguous(), ctx, 1.0, BEST)
    with pytest.raises(KernelError, match=r"'q' should be float32 \[n, H, D\]"):
        EXT.paged_prefill_attention(q[None], kp, vp, ctx, 1.0, BEST)
    with pytest.raises(KernelError, match=r"unknown ISA 'sse9'"):
        EXT.paged_prefill_attention(q, kp, vp, ctx, 1.0, "sse9")
