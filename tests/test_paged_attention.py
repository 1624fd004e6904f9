"""Paged decode attention (quill.kernels.fused.paged_decode_attention): reading keys and values in
the pool through slot tables gives the bits of the dense kernel on the gathered, masked rows, on
every ISA variant; the torch fallback agrees; bad tables are refused before any read."""

from __future__ import annotations

import pytest
import torch

from quill import native
from quill.errors import KernelError
from quill.kernels import fused
from quill.platform import detect

EXT = native.load().module
PLATFORM = detect()
ISAS = ["scalar"] + [name for name, flags in reversed(native.ISAS) if PLATFORM.has(*flags)]
BEST = native.isa_for(PLATFORM) or "scalar"  # what a model loaded here hands the kernel


def _paged_case(lens, h, hkv, d, block=16, seed=0):
    """A pool of shuffled blocks and, per sequence, the slot table of its context."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = sum(-(-n // block) for n in lens)
    nblocks = blocks_needed + 5
    k_pool = torch.randn(nblocks * block, hkv, d, generator=g) * 2  # [N, Hkv, D]
    v_pool = torch.randn(nblocks * block, hkv, d, generator=g)
    order = torch.randperm(nblocks, generator=g).tolist()  # blocks scattered across the pool
    smax = max(lens)
    slots = torch.zeros(len(lens), smax, dtype=torch.int64)
    for i, n in enumerate(lens):
        table = [order.pop() for _ in range(-(-n // block))]
        pos = torch.arange(n)
        slots[i, :n] = torch.tensor(table)[pos // block] * block + pos % block
    q = torch.randn(len(lens), 1, h, d, generator=g).transpose(1, 2)  # [B, H, 1, D], strided
    return q, k_pool, v_pool, slots, torch.tensor(lens, dtype=torch.int64)


def _gathered(q, k_pool, v_pool, slots, lens):
    kd = k_pool[slots].permute(0, 2, 1, 3).contiguous()  # [B, Hkv, Smax, D]
    vd = v_pool[slots].permute(0, 2, 1, 3).contiguous()
    mask = (torch.arange(slots.shape[1])[None, :] < lens[:, None])[:, None, None, :]
    return kd, vd, mask


CASES = [  # context lengths, H, Hkv, D
    ([1], 9, 3, 64),                  # SmolLM2-135M, first decode token
    ([700, 33, 1, 256], 9, 3, 64),    # mixed lengths, one needing no padding
    ([129, 64], 32, 8, 64),           # Llama-3.2-1B heads
    ([40, 41, 17], 4, 4, 128),        # no grouping, D = 128
    ([130, 64, 7, 16], 32, 4, 128),   # Qwen3-MoE heads: G = 8, blocks of keys and their remainders
    ([300, 70, 9], 4, 1, 256),        # Gemma 3's heads (and Qwen3.5's D): one KV head, blocks and remainders
    ([19, 5], 6, 2, 80),              # a head size with no specialisation
]


@pytest.mark.parametrize("lens,h,hkv,d", CASES)
@pytest.mark.parametrize("isa", ISAS)
def test_paged_equals_dense_on_gathered_rows_bit_for_bit(lens, h, hkv, d, isa):
    q, kp, vp, slots, ln = _paged_case(lens, h, hkv, d)
    kd, vd, mask = _gathered(q, kp, vp, slots, ln)
    want = EXT.decode_attention(q, kd, vd, mask, 0.125, isa)
    got = EXT.paged_decode_attention(q, kp, vp, slots, ln, 0.125, isa)
    assert got.shape == (len(lens), h, 1, d)
    assert torch.equal(got, want)
    assert torch.equal(got, EXT.paged_decode_attention(q, kp, vp, slots, ln, 0.125, "scalar"))


def test_torch_fallback_agrees():
    q, kp, vp, slots, ln = _paged_case([50, 3, 77], 8, 2, 64, seed=1)
    kd, vd, mask = _gathered(q, kp, vp, slots, ln)
    want = fused.decode_attention_torch(q, kd, vd, mask, 0.125)
    torch.testing.assert_close(fused.paged_decode_attention(q, kp, vp, slots, ln, 0.125), want,
                               rtol=1e-5, atol=1e-5)  # no ISA handed: torch
    got = fused.paged_decode_attention(q, kp, vp, slots, ln, 0.125, BEST)  # the ISA chosen at load: native
    assert torch.equal(got, EXT.paged_decode_attention(q, kp, vp, slots, ln, 0.125, BEST))
    bq = q.to(torch.bfloat16)  # no ISA handed: the torch path, in the query's dtype
    y = fused.paged_decode_attention(bq, kp.to(torch.bfloat16), vp.to(torch.bfloat16), slots, ln, 0.125)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("lens,h,hkv,d", CASES)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
def test_16_bit_pools_read_as_their_float32_values(lens, h, hkv, d, isa, pool_dtype):
    """A 16-bit KV cache's pool is widened exactly as it is read: the bits of a float32 pool of those values."""
    q, kp, vp, slots, ln = _paged_case(lens, h, hkv, d, seed=3)
    kb, vb = kp.to(pool_dtype), vp.to(pool_dtype)
    want = EXT.paged_decode_attention(q, kb.float(), vb.float(), slots, ln, 0.125, isa)
    assert torch.equal(EXT.paged_decode_attention(q, kb, vb, slots, ln, 0.125, isa), want)
    assert torch.equal(fused.paged_decode_attention(q, kb, vb, slots, ln, 0.125, isa), want)  # float32 compute
    y = fused.paged_decode_attention(q.to(torch.bfloat16), kb, vb, slots, ln, 0.125, isa)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, EXT.paged_decode_attention(q.to(torch.bfloat16).float(), kb.float(), vb.float(), slots,
                                                     ln, 0.125, isa).to(torch.bfloat16))
    with pytest.raises(KernelError, match="'v' pool"):
        EXT.paged_decode_attention(q, kb, vp, slots, ln, 0.125, isa)


def test_bad_tables_raise_kernel_error():
    q, kp, vp, slots, ln = _paged_case([20, 10], 4, 2, 16)
    bad = slots.clone()
    bad[1, 3] = kp.shape[0]
    with pytest.raises(KernelError, match=r"sequence 1 position 3 names pool row \d+; the pool has"):
        EXT.paged_decode_attention(q, kp, vp, bad, ln, 1.0, BEST)
    with pytest.raises(KernelError, match=r"sequence 0 has length 0; expected 1..20"):
        EXT.paged_decode_attention(q, kp, vp, slots, torch.tensor([0, 10]), 1.0, BEST)
    with pytest.raises(KernelError, match=r"'lens' should be int64 \[2\]"):
        EXT.paged_decode_attention(q, kp, vp, slots, ln.int(), 1.0, BEST)
    with pytest.raises(KernelError, match=r"'v' pool .* does not match 'k' pool"):
        EXT.paged_decode_attention(q, kp, vp[:-1], slots, ln, 1.0, BEST)
    with pytest.raises(KernelError, match=r"'k' pool should be contiguous float32, bfloat16 or float16 \[N, Hkv, 16\]"):
        EXT.paged_decode_attention(q, kp.double(), vp, slots, ln, 1.0, BEST)
