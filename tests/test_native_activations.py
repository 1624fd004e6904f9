"""Native activation encoders: the int8 quantizer (per token, per token and group, static) and the
float activations' split fixed-point image, every ISA variant against its definition in torch
(quill/kernels/activation.py, and the oracle below for the image), bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from quill.bench.stats import sqnr
from quill.canonical import ActivationQuant
from quill.kernels.activation import quantize_activations
from quill.native.pack import stream_order
from tests.test_native import EXT, FLOAT_VARIANTS, INT8_VARIANTS, _run, _weight


@pytest.mark.parametrize("isa", INT8_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_activation_quantizer_is_bit_exact(isa, dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 203, generator=g) * 3
    x[1] = 0.0  # zero scale -> eps
    x[2] = -x[2].abs()  # negative-only row (asymmetric lo/hi)
    x[3, :10] = torch.arange(10) * 0.5 - 2.25  # exact .5 ties once scaled
    x[3, 10] = 127.5 / 5
    x[4] *= 1e-30
    x = x.to(dtype)
    qw = _weight(16, 203, 4, -1)
    order = stream_order(qw)
    for aq in (ActivationQuant(), ActivationQuant(symmetric=False), ActivationQuant(dynamic=False, scale=0.05),
               ActivationQuant(dynamic=False, symmetric=False, scale=0.04, zero_point=3)):
        q, qsum, scale, zero = EXT.module.quantize_activations(
            x, order.seg_end, 8, None, aq.dynamic, aq.symmetric, aq.scale or 0.0, float(aq.zero_point or 0), isa)
        rq, rs, rz = quantize_activations(x, aq)
        assert torch.equal(q[:, :203], rq), (isa, aq)
        assert torch.equal(q[:, 203:], torch.zeros_like(q[:, 203:]))
        assert torch.equal(scale, rs.expand(7, 1).reshape(7)) and torch.equal(zero, rz.expand(7, 1).reshape(7))
        assert torch.equal(qsum[:, 0], rq.int().sum(1))


@pytest.mark.parametrize("isa", INT8_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gs,act_order,k", [(32, False, 224), (48, False, 240), (40, True, 200), (-1, False, 203)])
def test_per_group_activation_quantizer_is_bit_exact(isa, dtype, gs, act_order, k):
    """One scale per token and weight group (the stream's segments): the native quantizer, identity
    order and act-order (gathered), against the definition in quill.kernels.activation."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, k, generator=g) * 3
    x[1] = 0.0  # zero scales -> eps
    x[2, 40:80] = 0.0  # one all-zero group among others
    x[3, :10] = torch.arange(10) * 0.5 - 2.25
    x[4, 7] = 300.0  # an outlier: only its own group's scale grows
    x = x.to(dtype)
    qw = _weight(16, k, 4, gs, act_order=act_order).with_(activation=ActivationQuant(per_group=True))
    order = stream_order(qw)
    q, qsum, _, _, gscale = EXT.module.quantize_activations(x, order.seg_end, 8, order.src, True, True, 0.0, 0.0,
                                                            isa, per_segment=True)
    rq, rs, _ = quantize_activations(x, qw.activation, qw.group_index())
    src = order.src if order.src is not None else torch.cat([torch.arange(k), torch.full((q.shape[1] - k,), -1)])
    real = src >= 0
    assert torch.equal(q[:, real], rq[:, src[real]])
    assert torch.equal(q[:, ~real], torch.zeros_like(q[:, ~real]))
    groups = qw.group_index()[src[real]]  # [positions] the group of every real stream position
    seg_of = torch.bucketize(torch.arange(q.shape[1]), order.seg_end.long() * 8, right=True)[real]
    for s in range(len(order.seg_end)):  # each segment is one group: its scale is the group's
        cols = src[real][seg_of == s]
        assert torch.equal(gscale[:, s:s + 1].expand(-1, len(cols)), rs[:, cols]), (isa, s)
        assert len(set(groups[seg_of == s].tolist())) == 1
    sums = [q[:, real][:, seg_of == s].int().sum(1) for s in range(len(order.seg_end))]
    assert torch.equal(qsum, torch.stack(sums, 1))


# the largest |q| whose hi part fits int8: 127 * 65793 (24-bit image), 127 * 257 (16-bit)
QMAX = {24: 8355711, 16: 32639}


def _split_oracle(x: torch.Tensor, seg_end: torch.Tensor, chunk: int, src: torch.Tensor | None, image: int = 24):
    """The split image of float activations by its definition (csrc/common.h, scalar_util.h), in torch.

    Per segment: amax = max |x|; q = round_half_even(clamp((x * pre) * inv, -QMAX, QMAX)) with
    pre = 2^64 when amax < 2^-64 (else 1) and inv = QMAX / (amax * pre); r = floor((q + 128) / 256),
    lo = q - 256 * r; 24 bits: q = 65536 * hi + 256 * mid + lo with hi = floor((r + 128) / 256),
    mid = r - 256 * hi; 16 bits: q = 256 * hi + lo, hi = r; every part int8.  A segment holding inf
    or NaN is all zeros with scale NaN.
    Returns (stream int8 [M, parts * Kp] (per chunk: hi, (mid,) lo bytes), qsum [M, S, 2] (sum of hi,
    sum of q - SHIFT * hi), scale [M, S]).
    """
    qmax = QMAX[image]
    x = x.float()
    m, k = x.shape
    ends = [int(e) * chunk for e in seg_end]
    kp = ends[-1]
    if src is None:
        src = torch.cat([torch.arange(k), torch.full((kp - k,), -1)])
    xs = torch.where(src >= 0, x[:, src.clamp(min=0)], torch.zeros(()))  # [M, Kp]
    q = torch.zeros(m, kp, dtype=torch.int64)
    scale = torch.zeros(m, len(ends))
    p0 = 0
    for s, p1 in enumerate(ends):
        seg = xs[:, p0:p1]
        amax = seg.abs().amax(1)  # [M]; NaN propagates
        finite = torch.isfinite(amax)
        pre = torch.where(amax < 2.0 ** -64, torch.tensor(2.0 ** 64), torch.tensor(1.0))
        a = amax * pre
        inv = torch.where(a > 0, torch.tensor(float(qmax)) / a, torch.zeros(()))
        t = ((seg * pre[:, None]) * inv[:, None]).clamp(-qmax, qmax).round()
        q[:, p0:p1] = torch.where(finite[:, None], t, torch.zeros(())).long()
        scale[:, s] = torch.where(finite, amax / torch.tensor(float(qmax)), torch.tensor(float("nan")))
        p0 = p1
    r = torch.div(q + 128, 256, rounding_mode="floor")
    lo = q - 256 * r
    if image == 24:
        hi = torch.div(r + 128, 256, rounding_mode="floor")
        mid = r - 256 * hi
        parts, shift = (hi, mid, lo), 65536
    else:
        hi = r
        parts, shift = (hi, lo), 256
    for part in parts:
        assert part.min() >= -128 and part.max() <= 127
    assert torch.equal(shift * hi + (256 * mid + lo if image == 24 else lo), q)
    bounds = torch.tensor([0] + ends)
    seg_of = torch.bucketize(torch.arange(kp), bounds[1:], right=True)  # [Kp] segment of every position
    qsum = torch.zeros(m, len(ends), 2, dtype=torch.int64)
    qsum[:, :, 0].index_add_(1, seg_of, hi)
    qsum[:, :, 1].index_add_(1, seg_of, q - shift * hi)
    chunks = [t.to(torch.int8).view(m, -1, chunk) for t in parts]
    stream = torch.stack(chunks, 2).reshape(m, len(parts) * kp)
    return stream, qsum.int(), scale


@pytest.mark.parametrize("image", [24, 16])
@pytest.mark.parametrize("isa", FLOAT_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,gs,act_order,k", [(4, -1, False, 203), (4, 40, True, 200), (8, -1, False, 203),
                                                  (8, 12, False, 204), (4, 128, False, 256), (3, 64, False, 256),
                                                  (2, -1, False, 203)])
def test_split_encoder_matches_its_definition(isa, dtype, bits, gs, act_order, k, image):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, k, generator=g) * 3
    x[1] = 0.0  # all-zero segments: scale 0
    x[2, :20] = torch.arange(20) * 0.5 - 4.75  # ties once scaled
    x[3] *= 1e-30  # tiny: the 2^64 pre-scale
    x[4] *= 1e30
    x[5, 7] = float("inf")  # one segment becomes NaN, the others are kept
    x[6, 150] = float("nan")
    x[7, 3] = 5e4  # one large value: the rest of its segment at 2^-24 of it
    x = x.to(dtype)
    order = stream_order(_weight(16, k, bits, gs, act_order=act_order), 128)
    chunk = {2: 16, 3: 16, 4: 8, 8: 4}[bits]  # positions per chunk of each code width (common.h chunk_k)
    got = EXT.module.split_activations(x, order.seg_end, chunk, order.src, isa, image)
    want = _split_oracle(x, order.seg_end, chunk, order.src, image)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[2].isnan(), want[2].isnan())
    assert torch.equal(got[2].nan_to_num(), want[2].nan_to_num())
    assert got[2][5].isnan().sum() == 1 and got[2][6].isnan().sum() == 1


def test_float_activations_far_from_one_and_non_finite():
    qw = _weight(40, 256, 4, 128)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(6))
    x[0] *= 1e-30
    x[1] *= 1e25
    x[2, 17] = float("inf")
    x[3, 100] = 1e4  # an outlier: its 128-wide segment keeps 16 bits of 1e4
    ref = x.double() @ qw.dequantize().double().T
    for isa in FLOAT_VARIANTS:
        y = _run(qw, x, isa, int8=False).double()
        for row in (0, 1, 3):
            assert sqnr(y[row], ref[row]) >= 70, (isa, row, sqnr(y[row], ref[row]))
        assert y[2].isnan().all()  # every output of a token with an inf input (float would give inf or NaN)


def test_activation_quantizer_gathers_act_order():
    qw = _weight(16, 128, 4, 32, act_order=True)
    order = stream_order(qw)
    assert order.src is not None
    x = torch.randn(3, 128)
    rq = quantize_activations(x, ActivationQuant())[0]
    for isa in INT8_VARIANTS:
        q, qsum, _, _ = EXT.module.quantize_activations(x, order.seg_end, 8, order.src, True, True, 0.0, 0.0, isa)
        assert torch.equal(q, rq[:, order.src]) and torch.equal(qsum, q.int().view(3, 4, 32).sum(-1))
