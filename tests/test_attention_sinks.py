"""Attention sinks (gpt-oss: one learned logit per query head in the softmax denominator) in the native
attention kernels: paged decode, paged prefill and dense decode agree with the torch definition
(quill.kernels.fused.sink_attention_torch, transformers' eager formula) with and without a sliding window,
every ISA variant gives the scalar twin's bits, no sinks (None or an empty tensor) gives exactly what the
kernels gave before, and bad sinks are refused."""

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
pytestmark = pytest.mark.skipif(EXT is None, reason="native kernels not built")

CASES = [  # context lengths, H, Hkv, D, window
    ([70, 9, 1], 6, 2, 64, None),
    ([70, 33], 6, 2, 64, 16),
    ([40, 130], 8, 2, 16, 16),  # gpt-oss-like heads with no specialisation
]


def _pool(lens, h, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    k_pool = torch.randn(n + 3, hkv, d, generator=g) * 2
    v_pool = torch.randn(n + 3, hkv, d, generator=g)
    perm = torch.randperm(n + 3, generator=g)
    slots = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    at = 0
    for i, m in enumerate(lens):
        slots[i, :m] = perm[at:at + m]
        at += m
    q = torch.randn(len(lens), h, 1, d, generator=g)
    sinks = torch.randn(h, generator=g) * 3  # some far above the scores, some far below
    return q, k_pool, v_pool, slots, torch.tensor(lens), sinks


def _reference_decode(q, kp, vp, slots, lens, sinks, window):
    kd, vd = kp[slots].permute(0, 2, 1, 3), vp[slots].permute(0, 2, 1, 3)
    pos = torch.arange(slots.shape[1])[None, :]
    mask = pos < lens[:, None]
    if window is not None:
        mask &= pos >= lens[:, None] - window
    return fused.sink_attention_torch(q, kd, vd, mask[:, None, None, :], 0.25, sinks)


@pytest.mark.parametrize("lens,h,hkv,d,window", CASES)
def test_paged_decode_with_sinks(lens, h, hkv, d, window):
    q, kp, vp, slots, ln, sinks = _pool(lens, h, hkv, d)
    want = _reference_decode(q, kp, vp, slots, ln, sinks, window)
    outs = [EXT.paged_decode_attention(q, kp, vp, slots, ln, 0.25, isa, window or 0, sinks) for isa in ISAS]
    assert (outs[0] - want).abs().max() < 1e-5
    assert all(torch.equal(o, outs[0]) for o in outs[1:])  # every variant is the scalar twin
    without = EXT.paged_decode_attention(q, kp, vp, slots, ln, 0.25, ISAS[-1], window or 0)
    assert (without - outs[-1]).abs().max() > 1e-2  # the sinks change the result
    for none in (None, torch.empty(0)):  # no sinks: the bits the kernel gave before
        assert torch.equal(EXT.paged_decode_attention(q, kp, vp, slots, ln, 0.25, ISAS[-1], window or 0, none),
                           without)


@pytest.mark.parametrize("lens,h,hkv,d,window", CASES)
def test_paged_prefill_with_sinks(lens, h, hkv, d, window):
    q, kp, vp, slots, ln, sinks = _pool(lens, h, hkv, d, seed=1)
    ctx = slots[0, :lens[0]]
    n = min(lens[0], 37)  # the chunk: the context's last n positions
    qc = torch.randn(n, h, d, generator=torch.Generator().manual_seed(2))
    want = fused.paged_prefill_attention(qc, kp, vp, ctx, 0.25, None, window, sinks)  # torch
    outs = [EXT.paged_prefill_attention(qc, kp, vp, ctx, 0.25, isa, window or 0, sinks) for isa in ISAS]
    assert (outs[0] - want).abs().max() < 1e-5
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    without = EXT.paged_prefill_attention(qc, kp, vp, ctx, 0.25, ISAS[-1], window or 0)
    assert (without - outs[-1]).abs().max() > 1e-2
    assert torch.equal(EXT.paged_prefill_attention(qc, kp, vp, ctx, 0.25, ISAS[-1], window or 0, None), without)


def test_dense_decode_with_sinks_and_bad_sinks_refused():
    q, kp, vp, slots, ln, sinks = _pool([50, 20], 6, 2, 64, seed=3)
    kd, vd = kp[slots].permute(0, 2, 1, 3).contiguous(), vp[slots].permute(0, 2, 1, 3).contiguous()
    mask = (torch.arange(50)[None, :] < ln[:, None])[:, None, None, :]
    want = fused.sink_attention_torch(q, kd, vd, mask, 0.25, sinks)
    for isa in ISAS:
        assert (EXT.decode_attention(q, kd, vd, mask, 0.25, isa, sinks) - want).abs().max() < 1e-5
    with pytest.raises(KernelError, match=r"'sinks' should be float32 \[6\] \(one per query head\)"):
        EXT.paged_decode_attention(q, kp, vp, slots, ln, 0.25, ISAS[0], 0, torch.zeros(5))
    with pytest.raises(KernelError, match=r"'sinks' should be float32 \[6\]"):
        EXT.paged_prefill_attention(q[0, :, :, :].transpose(0, 1), kp, vp, slots[0, :50], 0.25, ISAS[0], 0,
                                    torch.zeros(6, dtype=torch.float64))
    with pytest.raises(KernelError, match="attention sinks: expected one per query head"):
        fused.sink_attention_torch(q, kd, vd, mask, 0.25, torch.zeros(3))
