"""Every auto-round fixture (GPTQ, AWQ and AutoRound packings; dense and MoE) against the tool's own dequantization."""

import json
import re

import pytest
import torch
from fixture_util import expected_weights, fixture_names, fixture_path

from quill.formats.checkpoint import open_checkpoint
from quill.formats.safetensors_io import TensorStore

FIXTURES = fixture_names("ar-")


def test_all_autoround_fixtures_are_here():
    assert len(FIXTURES) == 8, FIXTURES


def _left_unquantized(name: str) -> list[str]:
    """The linear modules the tool kept dense, as its FIXTURE.md lists them (an independent record)."""
    text = (fixture_path(name) / "FIXTURE.md").read_text()
    m = re.search(r"Linear modules left unquantized by the tool \(not in expected\): (.*)\.\n", text)
    assert m, f"{name}/FIXTURE.md does not list the unquantized modules"
    return [s.strip() for s in m.group(1).split(",")]


@pytest.mark.parametrize("name", FIXTURES)
def test_dequantizes_exactly_to_the_tools_weights(name):
    ckpt = open_checkpoint(fixture_path(name))
    expected = expected_weights(name)
    seen = set()
    for module, qw in ckpt.quantized_layers():
        seen.add(module)
        want = expected[module]
        assert qw.dequantize().shape == want.shape
        assert torch.equal(qw.dequantize(), want), f"{module}: max abs diff {(qw.dequantize() - want).abs().max()}"
    assert seen == set(expected)


@pytest.mark.parametrize("name", FIXTURES)
def test_unquantized_modules_come_out_dense(name):
    path = fixture_path(name)
    ckpt = open_checkpoint(path)
    dense = dict(ckpt.dense_tensors())
    tied = json.loads((path / "config.json").read_text()).get("tie_word_embeddings", False)
    for module in _left_unquantized(name):
        if module == "lm_head" and tied:
            assert "lm_head.weight" not in TensorStore(path).names()  # the output projection is embed_tokens
            continue
        assert f"{module}.weight" in dense, module
        assert dense[f"{module}.weight"].dim() == 2
    # nothing packed leaks into the dense tensors, and together they cover the whole checkpoint
    assert not [n for n in dense if n.rpartition(".")[2] in ("qweight", "qzeros", "scales", "g_idx")]
    assert set(dense) | ckpt.consumed() == set(TensorStore(path).names())


@pytest.mark.parametrize("name", FIXTURES)
def test_biases_and_scales_are_the_stored_ones(name):
    path = fixture_path(name)
    ckpt = open_checkpoint(path)
    store = TensorStore(path)
    for module, qw in ckpt.quantized_layers():
        assert torch.equal(qw.scales, store.get(f"{module}.scales").T)
        if f"{module}.bias" in store:
            assert torch.equal(qw.bias, store.get(f"{module}.bias"))
        else:
            assert qw.bias is None


def test_mixed_precision_layers_follow_extra_config():
    layers = dict(open_checkpoint(fixture_path("ar-mixed-llama")).quantized_layers())
    assert (layers["model.layers.0.self_attn.q_proj"].bits, layers["model.layers.0.self_attn.q_proj"].group_size) \
        == (8, 128)
    assert (layers["model.layers.0.mlp.down_proj"].bits, layers["model.layers.0.mlp.down_proj"].group_size) == (8, 32)
    assert (layers["model.layers.1.mlp.down_proj"].bits, layers["model.layers.1.mlp.down_proj"].group_size) == (4, 128)


@pytest.mark.parametrize("name,symmetric", [
    ("ar-autogptq-asym-g128-llama", False), ("ar-autoawq-asym-g64-qwen2", False), ("ar-autogptq-sym-g64-qwen3", True),
    ("ar-autoawq-sym-g128-llama", True), ("ar-w8-autogptq-llama", True)])
def test_symmetric_fixtures_become_canonical_symmetric(name, symmetric):
    for _, qw in open_checkpoint(fixture_path(name)).quantized_layers():
        assert qw.symmetric == symmetric and qw.g_idx is None


def test_moe_routers_excluded_by_dynamic_stay_dense():
    ckpt = open_checkpoint(fixture_path("ar-autogptq-qwen3moe"))
    assert ckpt.quant_config["dynamic"]  # '-:' rules are how auto-round excluded the routers
    dense = dict(ckpt.dense_tensors())
    for layer in (0, 1):
        assert dense[f"model.layers.{layer}.mlp.gate.weight"].shape == (8, 128)
        assert f"model.layers.{layer}.mlp.gate" not in ckpt.plan
    assert sum(".experts." in m for m in ckpt.plan) == 2 * 8 * 3
