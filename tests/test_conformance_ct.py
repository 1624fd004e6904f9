"""Conformance with the real llm-compressor / compressed-tensors fixtures (../shared/fixtures/ct-*).

Every oracle here is independent of quill's reader: the tool's own dequantized
weights (expected.safetensors), the raw checkpoint tensors read with the
safetensors package, and activation QDQ written out in the test from
compressed-tensors' documented formula.
"""

import pytest
import torch
from safetensors import safe_open

from quill.canonical import ActivationQuant
from quill.formats.checkpoint import open_checkpoint
from quill.kernels import KernelPolicy, KernelSelector, build_quant_linear
from quill.kernels.activation import fake_quantize_activations
from quill.platform import Platform
from tests.fixture_util import expected_weights, fixture_names, fixture_path

CT_FIXTURES = fixture_names("ct-")
PLAT = Platform(vendor="AMD", microarch="zen3", flags=frozenset({"avx2", "fma", "f16c"}))
QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
                  "input_scale", "input_zero_point")


def raw_tensors(name):
    """Every tensor of a fixture, read with the safetensors package (not quill's store)."""
    out = {}
    for f in sorted(fixture_path(name).glob("model*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def test_all_ten_fixtures_present():
    assert len(CT_FIXTURES) == 10, CT_FIXTURES


@pytest.mark.parametrize("name", CT_FIXTURES)
def test_dequantizes_exactly_to_the_tools_weights(name):
    ckpt = open_checkpoint(fixture_path(name))
    expected = expected_weights(name)
    layers = dict(ckpt.quantized_layers())
    assert sorted(layers) == sorted(expected)
    for module, qw in layers.items():
        got = qw.dequantize()
        assert got.shape == expected[module].shape, module
        assert float((got - expected[module]).abs().max()) == 0.0, module


@pytest.mark.parametrize("name", CT_FIXTURES)
def test_dense_tensors_and_biases(name):
    ckpt = open_checkpoint(fixture_path(name))
    raw = raw_tensors(name)
    layers = dict(ckpt.quantized_layers())
    dense = dict(ckpt.dense_tensors())
    # every stored tensor is consumed by exactly one quantized layer or comes out dense
    assert set(dense) | ckpt.consumed() == set(raw) and not set(dense) & ckpt.consumed()
    assert not [n for n in dense if n.rsplit(".", 1)[1] in QUANT_SUFFIXES]
    for n, t in dense.items():
        assert torch.equal(t, raw[n]), n
    ignored = [n for n in raw if n.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight", "lm_head.weight"))]
    assert ignored == [n for n in ignored if n in dense]  # routers and lm_head stay dense
    if "moe" in name or "mixtral" in name:
        assert len([n for n in ignored if "gate." in n]) == 2
    for module, qw in layers.items():
        if f"{module}.bias" in raw:
            assert qw.bias is not None and torch.equal(qw.bias, raw[f"{module}.bias"])
        else:
            assert qw.bias is None


def test_w8a8_activation_quantization():
    for module, qw in open_checkpoint(fixture_path("ct-w8a8-dynamic-llama")).quantized_layers():
        assert qw.activation == ActivationQuant(bits=8, dynamic=True, symmetric=True), module
        assert qw.bits == 8 and qw.per_channel and qw.symmetric
    raw = raw_tensors("ct-w8a8-static-qwen2")
    for module, qw in open_checkpoint(fixture_path("ct-w8a8-static-qwen2")).quantized_layers():
        stored = raw[f"{module}.input_scale"]
        assert stored.dtype == torch.bfloat16 and stored.shape == (1,)
        assert qw.activation == ActivationQuant(bits=8, dynamic=False, symmetric=True, scale=float(stored[0]))
    for name in fixture_names("ct-w4a16") + ["ct-w8a16-g128-llama"]:
        assert all(qw.activation is None for _, qw in open_checkpoint(fixture_path(name)).quantized_layers())


# ---- compressed-tensors' activation QDQ, written out independently ------------

def ct_qdq(x, dynamic, symmetric=True, scale=None, zero=None):
    """compressed-tensors calculate_qparams + fake_quantize for int8 inputs, per token (last dim) or static."""
    x = x.float()
    if dynamic:
        lo = torch.minimum(x.amin(-1, keepdim=True), torch.zeros(()))
        hi = torch.maximum(x.amax(-1, keepdim=True), torch.zeros(()))
        if symmetric:
            scale = torch.maximum(lo.abs(), hi.abs()) / (255.0 / 2)
            zero = torch.zeros_like(scale)
        else:
            scale = (hi - lo) / 255.0
            zero = torch.clamp(-128 - lo / scale, -128, 127)  # before the zero-scale fix, as in calculate_qparams
            zero = torch.round(torch.nan_to_num(zero))  # 0/0 rows: any zero point gives 0 output
        scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    else:
        scale = torch.tensor(scale, dtype=torch.float32)
        zero = torch.tensor(float(zero or 0))
    q = torch.round(torch.clamp(x / scale + zero, -128, 127))
    return (q - zero) * scale


STATIC_SCALE = 0.0234375  # 3/128: k/2 * scale and back are exact in float32


def _inputs(k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, k, generator=g) * 3
    x[0, 0] = 0  # an all-zero token
    x[0, 1] = torch.randn(k, generator=g).abs()  # one-sided tokens
    x[0, 2] = -x[0, 1]
    # exact ties (half-way between codes) for the static scale below, and values past the int8 range
    x[1, 3, :8] = STATIC_SCALE * torch.tensor([2.5, 3.5, -2.5, -0.5, 126.5, -127.5, 300.0, -300.0])
    return x


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dynamic", [True, False])
def test_fake_quantize_activations_matches_compressed_tensors(dynamic, symmetric):
    x = _inputs(64, 7).reshape(-1, 64)
    if dynamic:
        act = ActivationQuant(dynamic=True, symmetric=symmetric)
        want = ct_qdq(x, True, symmetric)
    else:  # a static scale small enough that the clamp matters
        act = ActivationQuant(dynamic=False, symmetric=symmetric, scale=STATIC_SCALE,
                              zero_point=None if symmetric else -7)
        want = ct_qdq(x, False, scale=STATIC_SCALE, zero=0 if symmetric else -7)
    assert torch.equal(fake_quantize_activations(x, act), want)


@pytest.mark.parametrize("name, module", [("ct-w8a8-dynamic-llama", "model.layers.0.self_attn.q_proj"),
                                          ("ct-w8a8-static-qwen2", "model.layers.1.self_attn.k_proj"),
                                          ("ct-w8a8-static-qwen2", "model.layers.0.mlp.down_proj")])
def test_w8a8_linear_through_reference_kernel(name, module):
    ckpt = open_checkpoint(fixture_path(name))
    qw = ckpt.read_layer(module)
    raw = raw_tensors(name)
    w = expected_weights(name)[module]  # [N, K], the tool's own dequantization
    x = _inputs(qw.in_features, 11)  # [2, 16, K]
    if qw.activation.dynamic:
        x_qdq = ct_qdq(x, True)
    else:
        x_qdq = ct_qdq(x, False, scale=float(raw[f"{module}.input_scale"][0]))
    want = x_qdq @ w.T
    if f"{module}.bias" in raw:
        want = want + raw[f"{module}.bias"].float()
    linear = build_quant_linear(qw, KernelSelector(PLAT, KernelPolicy(force="reference")))
    got = linear(x)
    assert linear.kernel_name == "reference" and got.shape == (2, 16, qw.out_features)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # the quantization really happened: unquantized inputs give a visibly different result
    assert float((x @ w.T - x_qdq @ w.T).abs().max()) > 1e-3
