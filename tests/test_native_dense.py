"""The native dense 16-bit linear (quill/native/csrc/dense*.cpp) and its use by build_dense_linear.

Every ISA variant must equal the scalar twin bit for bit (the same fused multiply-adds in
the same order per lane); against float64 the float32 results are as accurate as torch's
float32 matmul (~130 dB).
"""

from __future__ import annotations

import pytest
import torch

from quill import native
from quill.bench.stats import sqnr
from quill.errors import KernelError
from quill.kernels import KernelPolicy, KernelSelector, build_dense_linear
from quill.native.pack import pack_dense
from quill.platform import detect

PLATFORM = detect()
EXT = native.load().module
ISAS = ["scalar"] + [name for name, flags in native.ISAS if PLATFORM.has(*flags)]




def _handle(w: torch.Tensor, isa: str, threads: int = 2):
    dtype = "bfloat16" if w.dtype == torch.bfloat16 else "float16"
    return EXT.NativeDense(pack_dense(w), w.shape[0], w.shape[1], dtype, isa, threads)


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(37, 203), (16, 64), (300, 1030)])
def test_variants_bit_exact_and_accurate(wdtype, xdtype, n, k):
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(wdtype)
    bias = torch.randn(n, generator=g)
    x = torch.randn(5, k, generator=g).to(xdtype)
    outs = {isa: _handle(w, isa).forward(x, bias) for isa in ISAS}
    for isa, y in outs.items():
        assert y.dtype == xdtype and y.shape == (5, n)
        assert torch.equal(y, outs["scalar"]), isa
    ref = x.double() @ w.double().T + bias.double()
    limit = {torch.float32: 110, torch.bfloat16: 45, torch.float16: 60}[xdtype]  # 16-bit: the output rounding
    assert sqnr(outs["scalar"], ref) >= limit


@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 7, 12, 17])
def test_every_m_and_thread_count(m):
    g = torch.Generator().manual_seed(m)
    w = (torch.randn(70, 600, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, 600, generator=g)
    base = _handle(w, "scalar", 1).forward(x)
    for threads in (1, 2):
        for isa in ISAS:
            assert torch.equal(_handle(w, isa, threads).forward(x), base)
    assert sqnr(base, x.double() @ w.double().T) >= 110


def test_long_inputs_three_d_and_token_blocks():
    # 300 tokens: two blocks of at most 252; K blocks of 256 column pairs
    g = torch.Generator().manual_seed(9)
    w = (torch.randn(40, 1100, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(3, 100, 1100, generator=g)
    ys = [_handle(w, isa).forward(x) for isa in ISAS]
    assert ys[0].shape == (3, 100, 40) and all(torch.equal(y, ys[0]) for y in ys)
    assert sqnr(ys[0], x.double() @ w.double().T) >= 110


def test_preconditions_raise_kernel_error():
    w = torch.randn(16, 64).to(torch.bfloat16)
    words = pack_dense(w)
    with pytest.raises(KernelError, match=r"words should be contiguous int16 \[1, 33, 16, 2\] for a \[16, 66\] "
                                          r"weight, found short int \[1, 32, 16, 2\]"):
        EXT.NativeDense(words, 16, 66, "bfloat16", "scalar", 1)
    with pytest.raises(KernelError, match="unknown ISA 'sse9'"):
        EXT.NativeDense(words, 16, 64, "bfloat16", "sse9", 1)
    with pytest.raises(KernelError, match="weight dtype 'float32' is not supported"):
        EXT.NativeDense(words, 16, 64, "float32", "scalar", 1)
    h = EXT.NativeDense(words, 16, 64, "bfloat16", "scalar", 1)
    with pytest.raises(KernelError, match=r"input should be a float32/bfloat16/float16 CPU tensor \[\.\.\., 64\]"):
        h.forward(torch.randn(2, 63))
    with pytest.raises(KernelError, match="bias should have 16 values"):
        h.forward(torch.randn(2, 64), torch.randn(15))
    with pytest.raises(KernelError, match="2-D bfloat16/float16"):
        pack_dense(torch.randn(4, 4))


# ---- build_dense_linear ---------------------------------------------------------------------------

def test_build_dense_linear_holds_16_bit_weights_natively():
    sel = KernelSelector(PLATFORM)
    w16 = (torch.randn(48, 96) * 0.1).to(torch.bfloat16)
    x = torch.randn(3, 96)
    # a bf16 checkpoint weight in the float32 runtime: 16-bit words, float32 arithmetic
    lin = build_dense_linear("lm_head", w16, None, torch.float32, sel)
    assert lin.kernel_name == "native_dense" and lin.weight is None and lin.dtype == torch.bfloat16
    assert lin.weight_bytes == 48 * 96 * 2
    torch.testing.assert_close(lin(x), x @ w16.float().T, rtol=1e-5, atol=1e-5)
    # float32 values that are bf16 numbers (a bf16 embedding tied as lm_head, already widened)
    assert build_dense_linear("lm_head", w16.float(), None, torch.float32, sel).kernel_name == "native_dense"
    # float16 weights, and the bfloat16 runtime (weights rounded to bf16 as the torch path does)
    wh = (torch.randn(48, 96) * 0.1).half()
    assert build_dense_linear("x", wh, None, torch.float32, sel).dtype == torch.float16
    lb = build_dense_linear("x", wh, torch.randn(48), torch.bfloat16, sel)
    ref = build_dense_linear("x", wh, lb.bias, torch.bfloat16)  # the torch path
    assert lb.kernel_name == "native_dense" and ref.kernel_name == "dense"
    xb = x.to(torch.bfloat16)
    assert sqnr(lb(xb), ref(xb)) >= 45 and lb(xb).dtype == torch.bfloat16


def test_build_dense_linear_keeps_torch_where_it_must():
    sel = KernelSelector(PLATFORM)
    w32 = torch.randn(16, 32)  # genuine float32 values
    assert build_dense_linear("x", w32, None, torch.float32, sel).kernel_name == "dense"
    w16 = torch.randn(16, 32).to(torch.bfloat16)
    assert build_dense_linear("x", w16, None, torch.float32).kernel_name == "dense"  # no selector
    forced = KernelSelector(PLATFORM, KernelPolicy(force="torch"))
    assert build_dense_linear("x", w16, None, torch.float32, forced).kernel_name == "dense"


def test_native_dense_goes_with_the_native_float_kernels():
    w16 = torch.randn(16, 32).to(torch.bfloat16)
    off = KernelSelector(PLATFORM, KernelPolicy(disabled=frozenset({"native_w4a16"})))
    assert build_dense_linear("x", w16, None, torch.float32, off).kernel_name == "dense"
    on = KernelSelector(PLATFORM, KernelPolicy(force="native_w8a16"))
    assert build_dense_linear("x", w16, None, torch.float32, on).kernel_name == "native_dense"


def test_dense_kernels_are_a_registry_with_reasons():
    from quill.kernels.dense import DENSE_KERNELS, DenseLayerConfig
    sel = KernelSelector(PLATFORM)
    assert DENSE_KERNELS.default_priorities(PLATFORM)[0] == "native_dense"
    cfg = DenseLayerConfig(32, 16, torch.float32, None, torch.float32, PLATFORM)
    choice = sel.dense.select(cfg, layer="x")
    assert choice.name == "dense"
    assert choice.refusals == (("native_dense", "holds exact bfloat16 / float16 words only; this weight has "
                                                "float32 values that are neither"),)
    off = KernelSelector(PLATFORM, KernelPolicy(force="torch")).dense.select(
        DenseLayerConfig(32, 16, torch.bfloat16, torch.bfloat16, torch.float32, PLATFORM), layer="x")
    assert off.name == "dense" and "disabled by the linear kernel policy" in off.refusals[0][1]


def test_moe_dense_experts_get_the_native_dense_kernel():
    from quill.moe import linear_factory
    from quill.moe.experts import DenseWeight
    make = linear_factory(KernelSelector(PLATFORM, threads=1), torch.float32)
    w = (torch.randn(24, 64) * 0.1).to(torch.bfloat16)
    lin = make(DenseWeight(w, None, "model.layers.0.mlp.experts.3.up_proj"))
    assert lin.kernel_name == "native_dense" and lin.native.threads == 1
    x = torch.randn(5, 64)
    torch.testing.assert_close(lin(x), x @ w.float().T, rtol=1e-5, atol=1e-5)
