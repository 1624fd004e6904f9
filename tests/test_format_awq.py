"""AWQ reader: round trips through real files, versions, config spellings, exclusions, bad input."""

import warnings

import pytest
import torch
from checkpoint_writer import assert_same_weight, layer_tensors, random_weight, write_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

from quill.errors import CheckpointError, ConfigError, UnsupportedFormatError
from quill.formats.awq import AWQ_ORDER
from quill.formats.checkpoint import open_checkpoint, read_checkpoint
from quill.formats.registry import QuillDeprecationWarning
from quill.writers.awq import canonical_to_awq


def awq_config(group_size=32, zero_point=True, version="gemm", **extra):
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": zero_point,
            "version": version, **extra}


def write_awq(path, layers, cfg, dense=None, **kw):
    tensors = layer_tensors(layers, canonical_to_awq)
    tensors.update(dense or {})
    return write_checkpoint(path, tensors, cfg, **kw)


def read_all(path):
    return dict(read_checkpoint(path))


@settings(max_examples=30, deadline=None)
@given(sym=st.booleans(), gs=st.sampled_from([16, 32, 64, -1]), k_blocks=st.integers(1, 3),
       out=st.sampled_from([8, 16, 40, 64]), bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_round_trip_through_files(tmp_path_factory, sym, gs, k_blocks, out, bias, seed):
    qw = random_weight(out, 64 * k_blocks, 4, gs, sym, False, seed, bias)
    path = tmp_path_factory.mktemp("awq")
    write_awq(path, {"model.layers.3.self_attn.k_proj": qw}, awq_config(gs, zero_point=not sym))
    (name, got), = read_checkpoint(path)
    assert name == "model.layers.3.self_attn.k_proj"
    assert_same_weight(got, qw)
    assert torch.equal(got.dequantize(), qw.dequantize())


def test_interleaved_nibble_order_by_hand():
    """Slot j of a word holds output column order[j]: columns 0..7 -> 0x75316420."""
    codes = torch.arange(8, dtype=torch.uint8).reshape(8, 1).repeat(1, 32)  # out=8, in=32; row n holds n
    qw = random_weight(8, 32, 4, 32).with_(codes=codes)
    t = canonical_to_awq(qw)
    assert t["qweight"].shape == (32, 1) and int(t["qweight"][0, 0]) == 0x75316420
    assert [int(t["qweight"][0, 0]) >> (4 * j) & 15 for j in range(8)] == list(AWQ_ORDER)
    assert int(t["qzeros"][0, 0]) & 0xFFFFFFFF == 0x88888888  # symmetric: all 8


def test_zero_point_false_export_reads_as_symmetric(tmp_path):
    qw = random_weight(16, 64, 4, 32, sym=True, seed=2)
    write_awq(tmp_path, {"m": qw}, awq_config(zero_point=False))
    got = read_all(tmp_path)["m"]
    assert got.zeros is None
    assert_same_weight(got, qw)


def test_zero_point_false_with_real_zeros_is_refused(tmp_path):
    write_awq(tmp_path, {"m": random_weight(16, 64, 4, 32, sym=False, seed=3)}, awq_config(zero_point=False))
    with pytest.raises(ConfigError, match=r"layer m: the config says zero_point=false \(symmetric\) but 'm.qzeros' "
                                          r"holds zero points"):
        read_all(tmp_path)


@pytest.mark.parametrize("version", ["gemm", "GEMM", "exllama", "exllamav2", "ipex"])
def test_gemm_layout_versions(tmp_path, version):
    qw = random_weight(16, 64, 4, 32, sym=False, seed=4)
    write_awq(tmp_path, {"m": qw}, awq_config(version=version))
    assert_same_weight(read_all(tmp_path)["m"], qw)


@pytest.mark.parametrize("version", ["gemv", "gemv_fast", "marlin", "llm-awq"])
def test_other_versions_are_refused(tmp_path, version):
    write_awq(tmp_path, {"m": random_weight(16, 64)}, awq_config(version=version))
    with pytest.raises(UnsupportedFormatError, match=rf"quantization_config.version: AWQ '{version}' is not supported "
                                                     r"\(a different tensor layout\); supported: gemm, exllama, "
                                                     r"exllamav2, ipex"):
        open_checkpoint(tmp_path)


def test_autoawq_spellings_and_standalone_quant_config(tmp_path):
    """AutoAWQ's own quant_config.json: w_bit, q_group_size, "GEMM", no quant_method."""
    qw = random_weight(16, 128, 4, 128, sym=False, seed=5)
    cfg = {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}
    write_awq(tmp_path, {"m": qw}, cfg, config_file="quant_config.json")
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.quant_method == "awq" and ckpt.describe() == "awq (gemm), 4-bit, group 128, asym"
    assert_same_weight(dict(ckpt.quantized_layers())["m"], qw)


def test_modules_to_not_convert(tmp_path):
    layers = {"model.layers.0.mlp.gate_proj": random_weight(16, 64, seed=6)}
    dense = {"model.layers.0.mlp.gate.weight": torch.zeros(4, 64), "lm_head.weight": torch.zeros(8, 64),
             "visual.blocks.0.attn.qkv.weight": torch.zeros(8, 64)}
    cfg = awq_config(modules_to_not_convert=["model.layers.0.mlp.gate", "lm_head", "visual"])
    write_awq(tmp_path, layers, cfg, dense=dense)
    ckpt = open_checkpoint(tmp_path)  # 'mlp.gate' names whole components: gate_proj stays quantized
    assert list(dict(ckpt.quantized_layers())) == ["model.layers.0.mlp.gate_proj"]
    assert set(dense) <= set(dict(ckpt.dense_tensors()))


def test_modules_to_not_convert_naming_a_quantized_module(tmp_path):
    write_awq(tmp_path, {"model.layers.0.self_attn.k_proj": random_weight(16, 64)},
              awq_config(modules_to_not_convert=["k_proj"]))
    with pytest.raises(ConfigError, match=r"layer model.layers.0.self_attn.k_proj: stored quantized .*"
                                          r"modules_to_not_convert names it \('k_proj'\)"):
        open_checkpoint(tmp_path)
    write_awq(tmp_path, {"model.layers.0.self_attn.k_proj": random_weight(16, 64)},
              awq_config(modules_to_not_convert=[r".*self_attn\.k.*"]))
    with pytest.raises(ConfigError, match=r"modules_to_not_convert names it"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("method", ["cpu_awq", "awq_marlin"])
def test_deprecated_names_load_with_a_warning(tmp_path, method):
    layers = {"m": random_weight(16, 64, 4, 32, sym=False, seed=7)}
    write_awq(tmp_path / "new", layers, awq_config())
    write_awq(tmp_path / "old", layers, awq_config(quant_method=method))
    with pytest.warns(QuillDeprecationWarning, match=f"'{method}' is deprecated"):
        old = read_all(tmp_path / "old")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = read_all(tmp_path / "new")
    assert_same_weight(old["m"], new["m"])
    assert torch.equal(old["m"].dequantize(), new["m"].dequantize())


# ---- bad input -----------------------------------------------------------------------

def _one_layer(tmp_path, cfg=None, mutate=None):
    t = canonical_to_awq(random_weight(32, 64, 4, 32, sym=False, seed=11))
    if mutate:
        mutate(t)
    return write_checkpoint(tmp_path, {f"layer.{s}": v for s, v in t.items()}, cfg or awq_config())


@pytest.mark.parametrize("bits", [5, 8])
def test_unsupported_bits(tmp_path, bits):
    _one_layer(tmp_path, {**awq_config(), "bits": bits})
    with pytest.raises(UnsupportedFormatError, match=rf"quantization_config.bits: AWQ gemm with bits={bits} is not "
                                                     r"supported; supported: 4"):
        open_checkpoint(tmp_path)


def test_missing_group_size(tmp_path):
    cfg = awq_config()
    del cfg["group_size"]
    _one_layer(tmp_path, cfg)
    with pytest.raises(ConfigError, match=r"required field 'group_size' is missing"):
        open_checkpoint(tmp_path)


def test_group_size_not_dividing_in_features(tmp_path):
    _one_layer(tmp_path, awq_config(group_size=24))
    with pytest.raises(ConfigError, match=r"layer layer: group_size 24 does not divide in_features 64"):
        read_all(tmp_path)


@pytest.mark.parametrize("tensor", ["qzeros", "scales"])
def test_missing_tensor(tmp_path, tensor):
    _one_layer(tmp_path, mutate=lambda t: t.pop(tensor))
    with pytest.raises(CheckpointError, match=rf"layer layer: tensor\(s\) \['layer.{tensor}'\] missing from the "
                                              r"checkpoint; AWQ layers store qweight, qzeros, scales"):
        open_checkpoint(tmp_path)


def test_wrong_dtype(tmp_path):
    _one_layer(tmp_path, mutate=lambda t: t.update(scales=t["scales"].to(torch.int32)))
    with pytest.raises(CheckpointError, match=r"tensor 'layer.scales' has dtype torch.int32, expected torch.float32 "
                                              r"or torch.float16 or torch.bfloat16"):
        read_all(tmp_path)


def test_wrong_shape(tmp_path):
    _one_layer(tmp_path, mutate=lambda t: t.update(qzeros=t["qzeros"][:1]))
    with pytest.raises(CheckpointError, match=r"tensor 'layer.qzeros' has shape \[1, 4\], expected \[2, 4\]"):
        read_all(tmp_path)


def test_qweight_shaped_for_another_bit_width(tmp_path):
    """An 8-bit AWQ export (4 codes per int32) does not fit the 4-bit GEMM layout."""
    _one_layer(tmp_path, mutate=lambda t: t.update(qweight=torch.zeros(64, 8, dtype=torch.int32)))
    with pytest.raises(CheckpointError, match=r"'layer.qweight' has shape \[64, 8\], expected \[\*, 4\] for "
                                              r"out_features 32 \(from scales\) packed 8 per int32 at bits=4 "
                                              r"\(the tensor is shaped for bits=8\)"):
        read_all(tmp_path)


def test_group_size_contradicts_scales(tmp_path):
    _one_layer(tmp_path, awq_config(group_size=64))
    with pytest.raises(ConfigError, match=r"'layer.scales' has 2 groups but in_features 64 / group_size 64 = 1"):
        read_all(tmp_path)


def test_truncated_safetensors(tmp_path):
    _one_layer(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match=r"truncated file"):
        open_checkpoint(tmp_path)


def test_bad_modules_to_not_convert(tmp_path):
    _one_layer(tmp_path, awq_config(modules_to_not_convert="lm_head"))
    with pytest.raises(ConfigError, match=r"modules_to_not_convert: expected list, found 'lm_head'"):
        open_checkpoint(tmp_path)
