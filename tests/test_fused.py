"""Fused element-wise ops (quill/kernels/fused.py): the native versions against their torch definitions."""

from __future__ import annotations

import pytest
import torch

from quill import native
from quill.errors import KernelError
from quill.kernels import fused

EXT = native.load().module
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    # 16-bit results: one unit in the last place (a float32 intermediate that differs in its last
    # bit can round the other way); float32: summation order only
    tol = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


def test_extension_has_the_fused_ops():
    assert EXT is not None and all(hasattr(EXT, n) for n in ("rms_norm", "rope_", "silu_mul"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 2048), (2, 7, 576), (3, 5, 4, 64), (1, 1, 13), (600, 96)])
def test_rms_norm_matches_torch(dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    y = EXT.rms_norm(x, w, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    _close(y, fused.rms_norm_torch(x, w, 1e-5), dtype)
    assert torch.equal(fused.rms_norm(x, w, 1e-5), y)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,t,hq,hk,d", [(1, 1, 32, 8, 64), (2, 9, 4, 2, 128), (1, 300, 3, 1, 16)])
def test_rope_is_torch_exactly(dtype, b, t, hq, hk, d):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, t, hq, d, generator=g).to(dtype)
    k = torch.randn(b, t, hk, d, generator=g).to(dtype)
    ang = torch.rand(b, t, d // 2, generator=g) * 100
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    want_q, want_k = fused.rope_torch(q, cos, sin), fused.rope_torch(k, cos, sin)
    got_q, got_k = fused.rope_qk(q.clone(), k.clone(), cos, sin)
    # the same roundings in the same order: bit for bit
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_rope_of_non_contiguous_inputs():
    from quill.layers import apply_rope_qk
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(2, 3, 6, 32, generator=g)  # q, k as views of one projection
    q, k = qkv[:, :, :4], qkv[:, :, 4:]
    emb = torch.rand(2, 3, 32, generator=g)
    cos, sin = emb.cos(), emb.sin()
    want_q = fused.rope_torch(q, cos, sin)
    got_q, got_k = apply_rope_qk(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, fused.rope_torch(k, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(3)
    gate = (torch.randn(3, 5, 8192, generator=g) * 4).to(dtype)
    up = torch.randn(3, 5, 8192, generator=g).to(dtype)
    gate[0, 0, :4] = torch.tensor([0.0, -90.0, 90.0, 1e-3]).to(dtype)
    y = fused.silu_mul(gate, up)
    _close(y, fused.silu_mul_torch(gate, up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_and_sigmoid_match_torch(dtype):
    """The native ops Gemma's MLP and Qwen3.5's output / shared-expert gates run (in the Python layers and the
    native decode step alike)."""
    g = torch.Generator().manual_seed(4)
    gate = (torch.randn(3, 5, 8192, generator=g) * 4).to(dtype)
    up = torch.randn(3, 5, 8192, generator=g).to(dtype)
    gate[0, 0, :4] = torch.tensor([0.0, -90.0, 90.0, 1e-3]).to(dtype)
    _close(fused.gelu_tanh_mul(gate, up), fused.gelu_tanh_mul_torch(gate, up), dtype)
    _close(fused.sigmoid(gate), torch.sigmoid(gate), dtype)
    with pytest.raises(KernelError, match="gelu_tanh_mul: gate .* and up .* differ in shape"):
        EXT.gelu_tanh_mul(torch.randn(4), torch.randn(5))


def test_gelu_tanh_is_within_a_few_ulp_of_float64():
    """gelu-tanh's tanh is csrc/vmath.h's polynomial (vectorised), not libm's: against float64 over [-12, 12]
    (each branch of it, the switch at |inner| = 0.625, saturation past 9), infinities and NaN."""
    v = torch.cat([torch.linspace(-12, 12, 1 << 20), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0])])
    got = EXT.gelu_tanh_mul(v, torch.ones_like(v)).double()
    x = v.double()
    want = 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x ** 3)))
    err = (got - want).abs() / x.abs().clamp_min(1e-30)  # the error of 0.5 v (1 + tanh) scales with |v|
    assert float(err.max()) < 4e-7, float(err.max())
    special = EXT.gelu_tanh_mul(torch.tensor([float("inf"), -float("inf"), float("nan")]), torch.ones(3))
    assert special[0] == float("inf") and special[2].isnan()


def test_mixed_dtypes_and_grad_fall_back_to_torch():
    x = torch.randn(2, 8)
    w16 = torch.ones(8, dtype=torch.bfloat16)
    assert fused.rms_norm(x, w16, 1e-6).dtype == fused.rms_norm_torch(x, w16, 1e-6).dtype
    wg = torch.ones(8, requires_grad=True)
    assert fused.rms_norm(x, wg, 1e-6).requires_grad


def test_bad_shapes_raise_kernel_error():
    with pytest.raises(KernelError, match=r"rms_norm: weight \[7\] does not match"):
        EXT.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(KernelError, match="rope: expected contiguous x"):
        EXT.rope_(torch.randn(1, 2, 3, 5), torch.randn(1, 2, 5), torch.randn(1, 2, 5))
    with pytest.raises(KernelError, match="silu_mul: 'up' has dtype"):
        EXT.silu_mul(torch.randn(4), torch.randn(4, dtype=torch.bfloat16))
    with pytest.raises(KernelError, match="should be a CPU float32/bfloat16/float16"):
        EXT.rms_norm(torch.ones(2, 8, dtype=torch.int32), torch.ones(8, dtype=torch.int32), 1e-6)
