"""Merged projections (quill.layers.merged): q/k/v and gate/up run as one kernel call and give the
bits the separate calls give, on every kernel that runs the layer; parts that cannot share a
kernel (different bits, dense beside quantized) fall back to their own; a missing part is named."""

from __future__ import annotations

import pytest
import torch

from quill.errors import CheckpointError
from quill.kernels import KernelPolicy, KernelSelector
from quill.layers import LoadContext, linear, merged
from quill.platform import detect
from quill.writers.rtn import quantize_rtn

PLATFORM = detect()
KERNEL_CASES = [(None, None), ("reference", None), (None, "int8")]  # (forced kernel, activation quant)


def _ctx(kernel=None, activation=None) -> LoadContext:
    sel = KernelSelector(PLATFORM, KernelPolicy(force=kernel) if kernel else KernelPolicy(), exact_float=True)
    return LoadContext.from_selector(sel, torch.float32, activation)


def _weights(shapes, seed=0, **rtn):
    g = torch.Generator().manual_seed(seed)
    return [quantize_rtn(torch.randn(o, i, generator=g), generator=g, **rtn) for o, i in shapes]


def _group(shapes, bias=False):
    parts = [linear(i, o, bias) for o, i in shapes]
    return parts, merged(*parts)


def _load(parts, weights, ctx):
    for n, (p, w) in enumerate(zip(parts, weights)):
        name = f"layer.p{n}"
        if isinstance(w, torch.Tensor):
            p.load_tensor(name, "weight", w, ctx)
            p.finish(name, ctx)
        else:
            p.load_quantized(name, w.with_(name=name), ctx)


QKV = [(64, 128), (32, 128), (32, 128)]  # q, k, v of 4 query / 2 KV heads of 16, hidden 128


@pytest.mark.parametrize("kernel,activation", KERNEL_CASES)
@pytest.mark.parametrize("rtn", [dict(bits=4, group_size=32, symmetric=False), dict(bits=8, group_size=-1)])
def test_merged_outputs_are_the_separate_outputs_bit_for_bit(kernel, activation, rtn):
    ws = _weights(QKV, **rtn)
    ctx = _ctx(kernel, activation)
    parts, group = _group(QKV)
    _load(parts, ws, ctx)
    alone = [linear(i, o) for o, i in QKV]
    for n, (a, w) in enumerate(zip(alone, ws)):
        a.load_quantized(f"layer.p{n}", w.with_(name=f"layer.p{n}"), ctx)
    assert group.impl is not None  # one kernel for the three
    for m in (1, 5):
        x = torch.randn(1, m, 128, generator=torch.Generator().manual_seed(m))
        outs = group(x)
        for n, (got, a) in enumerate(zip(outs, alone)):
            assert got.shape == (1, m, QKV[n][0])
            assert torch.equal(got, a(x)), f"part {n}, {m} tokens"
            assert torch.equal(parts[n](x), got)  # a direct call of a part gives its rows too
    infos = [p.info(f"layer.p{n}") for n, p in enumerate(parts)]
    assert [i.name for i in infos] == ["layer.p0", "layer.p1", "layer.p2"]
    assert [i.weight_bytes for i in infos] == [w.storage_bytes() for w in ws]
    assert len({i.kernel for i in infos}) == 1


def test_biases_are_stacked_with_their_rows():
    ws = _weights(QKV, seed=1, bits=4, group_size=32)
    g = torch.Generator().manual_seed(2)
    ws = [w.with_(bias=torch.randn(w.out_features, generator=g)) for w in ws]
    ctx = _ctx()
    parts, group = _group(QKV, bias=True)
    _load(parts, ws, ctx)
    x = torch.randn(3, 128, generator=g)
    for got, w in zip(group(x), ws):
        torch.testing.assert_close(got, x @ w.dequantize().T + w.bias, rtol=1e-4, atol=1e-4)


def test_parts_that_cannot_share_a_kernel_run_alone():
    q, k = _weights(QKV[:2], seed=3, bits=4, group_size=32)
    (v,) = _weights(QKV[2:], seed=4, bits=8, group_size=-1)  # a K-quant mix: v at other bits
    ctx = _ctx()
    parts, group = _group(QKV)
    _load(parts, [q, k, v], ctx)
    assert group.impl is None
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(5))
    for got, w in zip(group(x), (q, k, v)):
        torch.testing.assert_close(got, x @ w.dequantize().T, rtol=1e-4, atol=1e-4)
    mixed_parts, mixed = _group(QKV[:2])  # one dense, one quantized
    dense = torch.randn(64, 128, generator=torch.Generator().manual_seed(6))
    _load(mixed_parts, [dense, k], ctx)
    assert mixed.impl is None
    torch.testing.assert_close(mixed(x)[0], x @ dense.T, rtol=1e-5, atol=1e-5)


def test_dense_parts_merge():
    g = torch.Generator().manual_seed(7)
    ws = [torch.randn(o, i, generator=g) for o, i in QKV]
    parts, group = _group(QKV)
    _load(parts, ws, _ctx())
    assert group.impl is not None
    x = torch.randn(2, 128, generator=g)
    for got, w in zip(group(x), ws):
        torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-5)


def test_a_missing_part_is_named():
    ws = _weights(QKV, seed=8, bits=4, group_size=32)
    ctx = _ctx()
    parts, group = _group(QKV)
    parts[0].load_quantized("layer.p0", ws[0].with_(name="layer.p0"), ctx)
    parts[2].load_quantized("layer.p2", ws[2].with_(name="layer.p2"), ctx)
    parts[0].check_filled("layer.p0", ctx)
    with pytest.raises(CheckpointError, match="no quantized layer or tensor for 'layer.p1'"):
        parts[1].check_filled("layer.p1", ctx)
