"""Native kernels on real checkpoints: every quantized layer of the tools' fixtures and of the default
GGUF model, selected by the normal kernel selection, against the tools' own dequantized weights."""

from __future__ import annotations

import pytest
import torch

import quill.default_model as default_model
from quill.bench.stats import sqnr
from quill.formats.checkpoint import open_checkpoint, read_checkpoint
from quill.kernels import KernelSelector, build_quant_linear
from quill.kernels.activation import fake_quantize_activations
from quill.platform import detect
from tests.fixture_util import expected_weights, fixture_path

PLATFORM = detect()

# fixture -> the native kernel selection must pick for its quantized layers
FIXTURES = {
    "ct-w4a16-actorder-llama": "native_w4a16",
    "ct-w4a16-asym-g32-qwen2": "native_w4a16",
    "ct-w4a16-sym-channel-qwen3": "native_w4a16",
    "ar-autoawq-asym-g64-qwen2": "native_w4a16",
    "ct-w8a16-g128-llama": "native_w8a16",
    "ar-w8-autogptq-llama": "native_w8a16",
    "ct-w8a8-dynamic-llama": "native_w8a8",
    "ct-w8a8-static-qwen2": "native_w8a8",
}




@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_layers_through_native_kernels(name):
    expected = expected_weights(name)
    selector = KernelSelector(PLATFORM)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    seen = 0
    for module, qw in read_checkpoint(fixture_path(name)):
        layer = build_quant_linear(qw, selector)
        assert layer.kernel_name == FIXTURES[name], module
        xi = x[:, : qw.in_features].float()
        if qw.activation is not None:  # W8A8: the checkpoint's own activation quantization (static: its scale)
            xi = fake_quantize_activations(xi, qw.activation)
        ref = xi @ expected[module].T
        y = layer(x[:, : qw.in_features])
        assert sqnr(y.float(), ref) >= 40, (module, sqnr(y.float(), ref))
        seen += 1
    assert seen == len(expected)


def test_default_model_layer_zero_q4_1_and_q8_0():
    ckpt = open_checkpoint(default_model.default_model_path())
    selector = KernelSelector(PLATFORM)
    kernels = set()
    for module, qw in ckpt.quantized_layers():
        if ".layers.0." not in module:
            continue
        layer = build_quant_linear(qw, selector)
        kernels.add(layer.kernel_name)
        x = torch.randn(3, qw.in_features, generator=torch.Generator().manual_seed(1))
        assert sqnr(layer(x), x @ qw.dequantize().T) >= 40, module
    assert "native_w4a16" in kernels  # Q4_1: float offsets
