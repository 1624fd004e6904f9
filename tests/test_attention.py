"""Decode attention (quill.kernels.fused.decode_attention): the native kernel and its torch spelling
against float64 scaled-dot-product attention; every ISA variant bit for bit against the scalar twin."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quill import native
from quill.errors import KernelError
from quill.kernels import fused
from quill.layers import attention
from quill.platform import detect

EXT = native.load().module
PLATFORM = detect()
ISAS = ["scalar"] + [name for name, flags in reversed(native.ISAS) if PLATFORM.has(*flags)]
BEST = native.isa_for(PLATFORM) or "scalar"  # what a model loaded here hands the kernel


def _case(b, h, hkv, s, d, seed=0, cap_extra=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 1, h, d, generator=g).transpose(1, 2)  # [B, H, 1, D], strided like the model's
    # k, v: the first S slots of a larger cache buffer, as KVCache hands them out
    kb = torch.randn(b, hkv, s + cap_extra, d, generator=g) * 2
    vb = torch.randn(b, hkv, s + cap_extra, d, generator=g)
    return q, kb[:, :, :s], vb[:, :, :s]


def _reference(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1]).float()


SHAPES = [  # B, H, Hkv, S, D
    (1, 32, 8, 512, 64),   # Llama-3.2-1B at 512 cached tokens
    (1, 9, 3, 1, 64),      # SmolLM2-135M, first token
    (2, 4, 4, 37, 128),    # no grouping, D = 128
    (3, 6, 2, 19, 80),     # a head size with no specialisation
    (1, 2, 1, 300, 7),     # odd D below the lane width
]


@pytest.mark.parametrize("b,h,hkv,s,d", SHAPES)
@pytest.mark.parametrize("isa", ISAS)
def test_native_matches_float64_sdpa(b, h, hkv, s, d, isa):
    q, k, v = _case(b, h, hkv, s, d)
    scale = d ** -0.5
    y = EXT.decode_attention(q, k, v, None, scale, isa)
    assert y.shape == (b, h, 1, d) and y.dtype == torch.float32
    torch.testing.assert_close(y, _reference(q, k, v, None, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b,h,hkv,s,d", SHAPES)
def test_isa_variants_are_the_scalar_twin_bit_for_bit(b, h, hkv, s, d):
    q, k, v = _case(b, h, hkv, s, d, seed=1)
    mask = torch.rand(b, 1, 1, s, generator=torch.Generator().manual_seed(2)) > 0.3
    mask[..., 0] = True
    for m in (None, mask):
        want = EXT.decode_attention(q, k, v, m, 0.1, "scalar")
        for isa in ISAS[1:]:
            assert torch.equal(EXT.decode_attention(q, k, v, m, 0.1, isa), want), isa


@pytest.mark.parametrize("rows", [1, 3])
def test_masks_per_sequence_and_broadcast(rows):
    q, k, v = _case(3, 8, 2, 41, 64, seed=3)
    g = torch.Generator().manual_seed(4)
    mask = torch.rand(rows, 1, 1, 41, generator=g) > 0.5
    mask[..., -1] = True  # every row sees at least its own token, as the cache guarantees
    want = _reference(q, k, v, mask, 0.125)
    torch.testing.assert_close(EXT.decode_attention(q, k, v, mask, 0.125, BEST), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.decode_attention_torch(q, k, v, mask, 0.125), want, rtol=1e-5, atol=1e-5)


def test_extreme_scores_and_a_fully_masked_row():
    q, k, v = _case(2, 4, 2, 64, 64, seed=5)
    k[0, 0, 10] = 1e3  # a score of ~1e4: its softmax weight is 1, every other exp underflows
    mask = torch.ones(2, 1, 1, 64, dtype=torch.bool)
    mask[1] = False  # a sequence that may attend nowhere: zeros, not NaN (SDPA gives NaN)
    y = EXT.decode_attention(q, k, v, mask, 0.125, BEST)
    torch.testing.assert_close(y[:1], _reference(q[:1], k[:1], v[:1], None, 0.125), rtol=1e-5, atol=1e-5)
    assert torch.equal(y[1], torch.zeros_like(y[1]))


def test_layer_attention_routes_decode_and_prompts():
    q, k, v = _case(2, 8, 2, 30, 64, seed=6)
    torch.testing.assert_close(attention(q, k, v, None, 0.125), _reference(q, k, v, None, 0.125),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(attention(q, k, v, None, 0.125, BEST), EXT.decode_attention(q, k, v, None, 0.125, BEST))
    g = torch.Generator().manual_seed(7)
    qp = torch.randn(2, 8, 30, 64, generator=g)  # a prompt: ATen's kernel, causal mask
    causal = torch.ones(30, 30, dtype=torch.bool).tril()[None, None]
    torch.testing.assert_close(attention(qp, k, v, causal, 0.125), _reference(qp, k, v, causal, 0.125),
                               rtol=1e-5, atol=1e-5)


def test_other_dtypes_take_the_torch_path():
    q, k, v = (t.to(torch.bfloat16) for t in _case(1, 4, 2, 16, 64, seed=8))
    y = fused.decode_attention(q, k, v, None, 0.125)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), _reference(q.float(), k.float(), v.float(), None, 0.125),
                               rtol=2e-2, atol=2e-2)


def test_bad_input_raises_kernel_error():
    q, k, v = _case(1, 6, 4, 8, 16)
    with pytest.raises(KernelError, match="6 query heads are not a multiple of 4 KV heads"):
        EXT.decode_attention(q, k, v, None, 1.0, BEST)
    q, k, v = _case(1, 4, 2, 8, 16)
    with pytest.raises(KernelError, match=r"'k' should be float32 \[1, Hkv, S, 16\]"):
        EXT.decode_attention(q, k.double(), v, None, 1.0, BEST)
    with pytest.raises(KernelError, match=r"'mask' should be bool \[B or 1, 1, 1, 8\]"):
        EXT.decode_attention(q, k, v, torch.ones(1, 1, 1, 9, dtype=torch.bool), 1.0, BEST)
    with pytest.raises(KernelError, match=r"'q' should be float32 \[B, H, 1, D\]"):
        EXT.decode_attention(torch.randn(1, 4, 2, 16), k, v, None, 1.0, BEST)
    with pytest.raises(KernelError, match="unknown ISA 'sse9'"):
        EXT.decode_attention(q, k, v, None, 1.0, "sse9")
