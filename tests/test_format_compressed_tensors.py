"""compressed-tensors reader: round trips through the writer, bit layouts, scheme resolution, bad input."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from quill.canonical import ActivationQuant
from quill.errors import CheckpointError, ConfigError, UnsupportedFormatError
from quill.formats.checkpoint import open_checkpoint, read_checkpoint
from quill.writers.compressed_tensors import (
    quantization_config,
    scheme_config,
    to_compressed_tensors,
)
from quill.writers.rtn import quantize_rtn

DOWN = "model.layers.0.mlp.down_proj"
UP = "model.layers.0.mlp.up_proj"


def write_checkpoint(path, modules, qcfg, dense=None):
    """modules: {module: {suffix: tensor}}; dense: {full name: tensor}."""
    tensors = {f"{m}.{s}": t.contiguous() for m, ts in modules.items() for s, t in ts.items()}
    tensors.update(dense or {})
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qcfg}))
    return path


def rtn(out=8, inp=64, bits=4, gs=16, sym=True, act_order=False, seed=0, scale_dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    return quantize_rtn(torch.randn(out, inp, generator=g), bits, gs, symmetric=sym, act_order=act_order,
                        generator=g, scale_dtype=scale_dtype)


def one_module_checkpoint(path, qw, fmt="pack-quantized", group_overrides=None, qcfg_overrides=None, **write_kw):
    tensors = to_compressed_tensors(qw, fmt=fmt, **write_kw)
    group = scheme_config(qw, fmt=fmt, per_tensor=write_kw.get("per_tensor", False))
    group.update(group_overrides or {})
    qcfg = quantization_config({"group_0": group}, ignore=["lm_head"])
    qcfg.update(qcfg_overrides or {})
    dense = {"lm_head.weight": torch.randn(4, qw.in_features), "model.norm.weight": torch.ones(qw.in_features)}
    return write_checkpoint(path, {DOWN: tensors}, qcfg, dense)


def assert_same(a, b):
    assert torch.equal(a.codes, b.codes)
    assert a.scales.dtype == b.scales.dtype and torch.equal(a.scales, b.scales)
    assert (a.zeros is None) == (b.zeros is None) and (a.zeros is None or torch.equal(a.zeros, b.zeros))
    assert (a.g_idx is None) == (b.g_idx is None) and (a.g_idx is None or torch.equal(a.g_idx, b.g_idx))
    assert (a.bias is None) == (b.bias is None) and (a.bias is None or torch.equal(a.bias, b.bias))
    assert (a.bits, a.group_size, a.activation) == (b.bits, b.group_size, b.activation)
    assert torch.equal(a.dequantize(), b.dequantize())


ACTIVATIONS = [None, ActivationQuant(dynamic=True), ActivationQuant(dynamic=True, symmetric=False),
               ActivationQuant(dynamic=False, scale=0.03125), ActivationQuant(dynamic=False, symmetric=False,
                                                                            scale=0.0078125, zero_point=-5)]


@settings(max_examples=80, deadline=None)
@given(bits=st.sampled_from([2, 3, 4, 8]), fmt=st.sampled_from(["pack-quantized", "int-quantized", "naive-quantized"]),
       sym=st.booleans(), strategy=st.sampled_from(["group", "channel", "tensor"]), act_order=st.booleans(),
       out=st.integers(1, 20), groups=st.integers(1, 4), gs=st.sampled_from([8, 16, 32]),
       legacy=st.booleans(), unpacked_zp=st.booleans(), bias=st.booleans(), act=st.sampled_from(ACTIVATIONS),
       scale_dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]), seed=st.integers(0, 2**31 - 1))
def test_round_trip(tmp_path_factory, bits, fmt, sym, strategy, act_order, out, groups, gs, legacy, unpacked_zp,
                    bias, act, scale_dtype, seed):
    inp = gs * groups
    qw = rtn(out, inp, bits, gs if strategy == "group" else -1, sym, act_order and strategy == "group", seed,
             scale_dtype)
    if strategy == "tensor":  # one scale (and zero point) for the whole weight
        qw = qw.with_(scales=qw.scales[:1, :1].expand(out, 1).contiguous(),
                      zeros=None if sym else qw.zeros[:1, :1].expand(out, 1).contiguous())
    b = torch.randn(out, generator=torch.Generator().manual_seed(seed)).to(scale_dtype) if bias else None
    qw = qw.with_(bias=b, activation=act)
    version = "0.17.1" if legacy else "0.19.0"
    path = one_module_checkpoint(tmp_path_factory.mktemp("ct"), qw, fmt, qcfg_overrides={"version": version},
                                 per_tensor=strategy == "tensor", legacy_packing=legacy,
                                 unpacked_zero_points=unpacked_zp)
    ckpt = open_checkpoint(path)
    layers = dict(ckpt.quantized_layers())
    assert list(layers) == [DOWN]
    assert_same(layers[DOWN], qw)
    assert sorted(n for n, _ in ckpt.dense_tensors()) == ["lm_head.weight", "model.norm.weight"]


# ---- bit layouts, checked against hand-computed words ---------------------

def test_pack_quantized_4bit_words_and_zero_points_along_output(tmp_path):
    # q + 8 nibbles, lowest first: codes 0..7 -> 0x76543210; zero points packed along dim 0
    codes = torch.arange(16, dtype=torch.uint8).reshape(2, 8)
    zeros = torch.tensor([[3], [12]], dtype=torch.int16)
    qw = quantize_rtn(torch.randn(2, 8), 4, -1, symmetric=False).with_(codes=codes, zeros=zeros)
    t = to_compressed_tensors(qw)
    assert t["weight_packed"].tolist() == [[0x76543210], [0xFEDCBA98 - (1 << 32)]]
    assert t["weight_zero_point"].shape == (1, 1) and t["weight_zero_point"].item() == 3 | (12 << 4)
    read = dict(read_checkpoint(one_module_checkpoint(tmp_path, qw)))[DOWN]
    assert torch.equal(read.codes, codes) and torch.equal(read.zeros, zeros)


def test_three_bit_dense_and_legacy_layouts(tmp_path):
    # >= 0.18 packs a bitstream (value 10 straddles words 0 and 1); <= 0.17 keeps 10 per word
    codes = torch.tensor([[7] * 32], dtype=torch.uint8)
    qw = quantize_rtn(torch.randn(1, 32), 3, -1).with_(codes=codes)
    dense = to_compressed_tensors(qw)["weight_packed"]
    legacy = to_compressed_tensors(qw, legacy_packing=True)["weight_packed"]
    assert dense.shape == (1, 3) and dense.tolist() == [[-1, -1, -1]]  # 96 bits all set
    assert legacy.shape == (1, 4) and legacy[0, 0].item() == (1 << 30) - 1 and legacy[0, 3].item() == 0x3F
    for kw, version in (({}, "0.19.0"), ({"legacy_packing": True}, "0.17.1")):
        path = one_module_checkpoint(tmp_path / version, qw, qcfg_overrides={"version": version}, **kw)
        assert torch.equal(dict(read_checkpoint(path))[DOWN].codes, codes)


def test_int_quantized_codes_are_q_plus_128(tmp_path):
    q = torch.tensor([[-128, -1, 0, 127]], dtype=torch.int8)
    scale = torch.tensor([[0.5]], dtype=torch.bfloat16)
    qcfg = quantization_config({"g": {"targets": ["Linear"], "format": "int-quantized",
                                      "weights": {"num_bits": 8, "strategy": "channel"}}})
    path = write_checkpoint(tmp_path, {DOWN: {"weight": q, "weight_scale": scale}}, qcfg)
    qw = dict(read_checkpoint(path))[DOWN]
    assert qw.codes.tolist() == [[0, 127, 128, 255]] and qw.zeros is None
    assert qw.dequantize().tolist() == [[-64.0, -0.5, 0.0, 63.5]]


def test_legacy_unpacked_symmetric_zero_points_are_accepted_only_when_zero(tmp_path):
    qw = rtn()
    tensors = to_compressed_tensors(qw)
    tensors["weight_zero_point"] = torch.zeros(qw.out_features, qw.num_groups, dtype=torch.int8)
    qcfg = quantization_config({"g": scheme_config(qw)})
    assert_same(dict(read_checkpoint(write_checkpoint(tmp_path / "a", {DOWN: tensors}, qcfg)))[DOWN], qw)
    tensors["weight_zero_point"][0, 0] = 1
    with pytest.raises(ConfigError, match="symmetric but .*weight_zero_point' holds nonzero"):
        list(read_checkpoint(write_checkpoint(tmp_path / "b", {DOWN: tensors}, qcfg)))


# ---- scheme resolution -----------------------------------------------------

def _two_layer_checkpoint(tmp_path, groups, ignore=(), stored=None):
    """Layers 0 and 1 with q_proj/down_proj; ``stored`` maps module -> format to write (None = dense)."""
    qw4, qw8 = rtn(bits=4), rtn(bits=8)
    modules, dense = {}, {}
    for m, fmt in stored.items():
        if fmt is None:
            dense[f"{m}.weight"] = torch.randn(8, 64)
        else:
            modules[m] = to_compressed_tensors(qw8 if fmt == "int-quantized" else qw4, fmt=fmt)
    return write_checkpoint(tmp_path, modules, quantization_config(groups, list(ignore)), dense)


def test_several_groups_exact_name_beats_regex_beats_class_and_group_format_overrides(tmp_path):
    w4 = scheme_config(rtn(bits=4), fmt="pack-quantized")
    w8 = scheme_config(rtn(bits=8), fmt="int-quantized")
    groups = {"a": {**w4, "targets": ["Linear"]},
              "b": {**w8, "targets": ["re:.*down_proj$", "model.layers.1.self_attn.q_proj"]},
              "c": {**w4, "targets": ["model.layers.1.mlp.down_proj"]}}
    stored = {"model.layers.0.self_attn.q_proj": "pack-quantized", "model.layers.1.self_attn.q_proj": "int-quantized",
              "model.layers.0.mlp.down_proj": "int-quantized", "model.layers.1.mlp.down_proj": "pack-quantized"}
    layers = dict(read_checkpoint(_two_layer_checkpoint(tmp_path, groups, stored=stored)))
    assert {m: qw.bits for m, qw in layers.items()} == {
        "model.layers.0.self_attn.q_proj": 4, "model.layers.1.self_attn.q_proj": 8,
        "model.layers.0.mlp.down_proj": 8, "model.layers.1.mlp.down_proj": 4}


def test_repeated_target_belongs_to_the_last_group(tmp_path):
    groups = {"a": {**scheme_config(rtn(bits=8), fmt="int-quantized"), "targets": ["Linear"]},
              "b": {**scheme_config(rtn(bits=4)), "targets": ["Linear"]}}
    layers = dict(read_checkpoint(_two_layer_checkpoint(tmp_path, groups, stored={DOWN: "pack-quantized"})))
    assert layers[DOWN].bits == 4


def test_ignore_by_name_and_regex_keeps_modules_dense(tmp_path):
    groups = {"g": scheme_config(rtn())}
    stored = {DOWN: "pack-quantized", UP: None, "model.layers.1.mlp.up_proj": None, "lm_head": None}
    path = _two_layer_checkpoint(tmp_path, groups, ignore=["lm_head", "re:.*up_proj$"], stored=stored)
    ckpt = open_checkpoint(path)
    assert [m for m, _ in ckpt.quantized_layers()] == [DOWN]
    assert sorted(n for n, _ in ckpt.dense_tensors()) == ["lm_head.weight", f"{UP}.weight",
                                                          "model.layers.1.mlp.up_proj.weight"]


def test_config_contradicts_tensors(tmp_path):
    groups = {"g": scheme_config(rtn())}
    # stored quantized, but ignored
    with pytest.raises(ConfigError, match=f"layer {DOWN}: config contradicts tensors.*ignored by 're:.*down"):
        _open(tmp_path / "a", groups, ["re:.*down_proj"], {DOWN: "pack-quantized"})
    # stored quantized, but no target reaches it
    only_q = {"g": {**scheme_config(rtn()), "targets": ["re:.*q_proj"]}}
    with pytest.raises(ConfigError, match=f"layer {DOWN}: .*matched by no target"):
        _open(tmp_path / "b", only_q, [], {DOWN: "pack-quantized"})
    # a Linear (its role is quantized in layer 0) stored dense in layer 1, not ignored
    with pytest.raises(ConfigError, match="layer model.layers.1.mlp.down_proj: config contradicts tensors.*dense"):
        _open(tmp_path / "c", groups, [], {DOWN: "pack-quantized", "model.layers.1.mlp.down_proj": None})
    # an exact-name target stored dense
    named = {"g": {**scheme_config(rtn()), "targets": ["Linear", "lm_head"]}}
    with pytest.raises(ConfigError, match="layer lm_head: config contradicts tensors.*target 'lm_head'"):
        _open(tmp_path / "d", named, [], {DOWN: "pack-quantized", "lm_head": None})
    # pack-quantized config, int8 weight on disk
    with pytest.raises(CheckpointError, match=f"'{DOWN}.weight_packed' is missing"):
        _open(tmp_path / "e", groups, [], {DOWN: "int-quantized"})


def _open(path, groups, ignore, stored):
    return open_checkpoint(_two_layer_checkpoint(path, groups, ignore, stored))


def test_norms_and_embeddings_are_not_linear(tmp_path):
    # a "Linear" target never reaches dense modules whose role has no quantized member
    groups = {"g": scheme_config(rtn())}
    stored = {DOWN: "pack-quantized", "model.embed_tokens": None, "model.layers.0.input_layernorm": None}
    ckpt = _open(tmp_path, groups, [], stored)
    assert list(ckpt.plan) == [DOWN]


# ---- bad input -----------------------------------------------------------

def _valid(tmp_path, **kw):
    return one_module_checkpoint(tmp_path, rtn(), **kw)


@pytest.mark.parametrize("overrides, error, pattern", [
    ({"format": "float-quantized"}, UnsupportedFormatError,
     "group_0.format: 'float-quantized' .*FP8.*supported: int-quantized, naive-quantized, pack-quantized"),
    ({"format": "nvfp4-pack-quantized"}, UnsupportedFormatError, "NVFP4"),
    ({"format": "marlin-24"}, UnsupportedFormatError, "marlin-24"),
    ({"format": "bogus"}, UnsupportedFormatError, "'bogus' is not supported"),
    ({"weights": {"num_bits": 5, "strategy": "channel"}}, UnsupportedFormatError,
     r"weights.num_bits: 5-bit .*supported: 2, 3, 4, 8"),
    ({"weights": {"num_bits": 8, "type": "float"}}, UnsupportedFormatError, "weights.type: float"),
    ({"weights": {"num_bits": 8, "strategy": "block", "block_structure": [128, 128]}}, UnsupportedFormatError,
     "'block'"),
    ({"weights": {"num_bits": 4, "strategy": "group"}}, ConfigError, "needs a positive group_size"),
    ({"weights": {"num_bits": 4, "strategy": "group", "group_size": 16, "actorder": "sideways"}}, ConfigError,
     "actorder"),
    ({"input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}},
     UnsupportedFormatError, "input_activations.type: float"),
    ({"input_activations": {"num_bits": 8, "strategy": "tensor", "dynamic": True}}, UnsupportedFormatError,
     "strategy 'tensor' and dynamic=True"),
    ({"output_activations": {"num_bits": 8}}, UnsupportedFormatError, "output_activations"),
    ({"targets": ["Embedding"]}, UnsupportedFormatError, "class 'Embedding' cannot be resolved"),
    ({"targets": ["re:(unclosed"]}, ConfigError, "invalid regular expression"),
])
def test_bad_group_config(tmp_path, overrides, error, pattern):
    with pytest.raises(error, match=pattern):
        open_checkpoint(_valid(tmp_path, group_overrides=overrides))


@pytest.mark.parametrize("overrides, pattern", [
    ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity"),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "KV-cache"),
    ({"transform_config": {"config_groups": {"u": {}}}}, "transforms"),
    ({"quantization_status": "frozen"}, "frozen"),
])
def test_unsupported_top_level(tmp_path, overrides, pattern):
    with pytest.raises(UnsupportedFormatError, match=pattern):
        open_checkpoint(_valid(tmp_path, qcfg_overrides=overrides))


def test_sparsity_dense_and_empty_transforms_are_fine(tmp_path):
    path = _valid(tmp_path, qcfg_overrides={"sparsity_config": {"format": "dense"}, "transform_config": None})
    assert [m for m, _ in read_checkpoint(path)] == [DOWN]


def test_group_size_not_dividing_in_features(tmp_path):
    path = _valid(tmp_path, group_overrides={"weights": {"num_bits": 4, "strategy": "group", "group_size": 24}})
    with pytest.raises(ConfigError, match=f"layer {DOWN}: group_size 24 does not divide in_features 64"):
        list(read_checkpoint(path))


def _mutated(tmp_path, mutate, qw=None, fmt="pack-quantized"):
    qw = qw or rtn()
    tensors = to_compressed_tensors(qw, fmt=fmt)
    mutate(tensors)
    return write_checkpoint(tmp_path, {DOWN: tensors}, quantization_config({"g": scheme_config(qw, fmt=fmt)}))


@pytest.mark.parametrize("mutate, error, pattern", [
    (lambda t: t.pop("weight_scale"), CheckpointError, f"'{DOWN}.weight_scale' is missing"),
    (lambda t: t.pop("weight_shape"), CheckpointError, f"'{DOWN}.weight_shape' is missing"),
    (lambda t: t.update(weight_scale=t["weight_scale"].to(torch.int32)), CheckpointError,
     f"'{DOWN}.weight_scale' has dtype torch.int32"),
    (lambda t: t.update(weight_packed=t["weight_packed"].to(torch.int64)), CheckpointError,
     f"'{DOWN}.weight_packed' has dtype torch.int64"),
    (lambda t: t.update(weight_scale=t["weight_scale"][:, :2].contiguous()), CheckpointError,
     rf"'{DOWN}.weight_scale' has shape \[8, 2\], expected \[8, 4\]"),
    (lambda t: t.update(weight_packed=t["weight_packed"][:, :7].contiguous()), CheckpointError,
     "7 int32 words do not hold 64 4-bit values; expected 8$"),
    (lambda t: t.update(weight_packed=torch.cat([t["weight_packed"]] * 2, 1)), CheckpointError,
     "16 int32 words do not hold 64 4-bit values"),
    (lambda t: t.update(weight_shape=torch.tensor([9, 64])), CheckpointError, r"weight_shape \[9, 64\] does not match"),
    (lambda t: t.update(weight_g_idx=torch.zeros(64, dtype=torch.int32)), ConfigError,
     rf"'{DOWN}.weight_g_idx' is not part of config group 'g' \(pack-quantized"),
    (lambda t: t.update(input_scale=torch.ones(1)), ConfigError, "input_scale' is not part of"),
    (lambda t: t.update(weight=torch.zeros(8, 64)), ConfigError, f"'{DOWN}.weight' is not part of"),
])
def test_bad_tensors(tmp_path, mutate, error, pattern):
    with pytest.raises(error, match=pattern):
        list(read_checkpoint(_mutated(tmp_path, mutate)))


def test_bad_asymmetric_and_act_order_tensors(tmp_path):
    asym = rtn(sym=False)
    with pytest.raises(CheckpointError, match=f"'{DOWN}.weight_zero_point' is missing"):
        list(read_checkpoint(_mutated(tmp_path / "a", lambda t: t.pop("weight_zero_point"), asym)))
    with pytest.raises(CheckpointError, match=r"weight_zero_point' has shape \[1, 3\], expected \[1, 4\]"):
        list(read_checkpoint(_mutated(tmp_path / "b", lambda t: t.update(
            weight_zero_point=t["weight_zero_point"][:, :3].contiguous()), asym)))
    ao = rtn(act_order=True)
    with pytest.raises(CheckpointError, match="weight_g_idx' assigns 17 columns to group 0"):
        list(read_checkpoint(_mutated(tmp_path / "c", lambda t: t["weight_g_idx"].copy_(
            torch.where(torch.arange(64) == int((t["weight_g_idx"] == 1).nonzero()[0]), 0, t["weight_g_idx"])), ao)))
    with pytest.raises(CheckpointError, match=r"weight' holds values in \[-128, .*signed 4-bit range"):
        list(read_checkpoint(_mutated(tmp_path / "d", lambda t: t["weight"].__setitem__((0, 0), -128),
                                      fmt="int-quantized")))


def test_static_activations_need_input_scale(tmp_path):
    qw = rtn(bits=8, gs=-1).with_(activation=ActivationQuant(dynamic=False, scale=0.5))
    with pytest.raises(CheckpointError, match=f"'{DOWN}.input_scale' is missing"):
        list(read_checkpoint(_mutated(tmp_path / "a", lambda t: t.pop("input_scale"), qw, "int-quantized")))
    with pytest.raises(CheckpointError, match="input_scale' is 0.0, expected a positive scale"):
        list(read_checkpoint(_mutated(tmp_path / "b", lambda t: t["input_scale"].zero_(), qw, "int-quantized")))


def test_truncated_safetensors(tmp_path):
    path = _valid(tmp_path)
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        open_checkpoint(path)


def test_fused_3d_experts_are_unsupported(tmp_path):
    def fuse(t):
        t["weight_packed"] = t["weight_packed"].unsqueeze(0).repeat(2, 1, 1)
        t["weight_shape"] = torch.tensor([2, 8, 64])
    with pytest.raises(UnsupportedFormatError, match="only 2-D weights are supported"):
        list(read_checkpoint(_mutated(tmp_path, fuse)))


def test_presets_and_inferred_formats(tmp_path):
    # a config group given as a preset name + targets; no format anywhere -> inferred like compressed-tensors
    qw = rtn(out=8, inp=128, bits=4, gs=128)
    qcfg = quantization_config({"W4A16": ["Linear"]}, fmt=None)
    qcfg.pop("format")
    path = write_checkpoint(tmp_path / "a", {DOWN: to_compressed_tensors(qw)}, qcfg)
    assert_same(dict(read_checkpoint(path))[DOWN], qw)
    w8a8 = rtn(out=8, inp=64, bits=8, gs=-1).with_(activation=ActivationQuant(dynamic=True))
    qcfg = quantization_config({"W8A8": ["Linear"]}, fmt="mixed-precision")
    path = write_checkpoint(tmp_path / "b", {DOWN: to_compressed_tensors(w8a8, fmt="int-quantized")}, qcfg)
    assert_same(dict(read_checkpoint(path))[DOWN], w8a8)
    with pytest.raises(UnsupportedFormatError, match="preset scheme 'FP8'"):
        open_checkpoint(write_checkpoint(tmp_path / "c", {}, quantization_config({"FP8": ["Linear"]})))


@pytest.mark.parametrize("actorder, strategy", [("weight", "group"), ("static", "group"), ("group", "channel")])
def test_act_order_without_runtime_index(tmp_path, actorder, strategy):
    # actorder 'weight' only changed calibration; 'group' with a non-group strategy never gets a g_idx
    qw = rtn(gs=16 if strategy == "group" else -1)
    group = scheme_config(qw)
    group["weights"]["actorder"] = actorder
    path = write_checkpoint(tmp_path, {DOWN: to_compressed_tensors(qw)}, quantization_config({"g": group}))
    assert_same(dict(read_checkpoint(path))[DOWN], qw)


def test_three_bit_ambiguous_width_needs_the_version(tmp_path):
    # 16 values: 2 words either way, but value 10 sits at bits 30-32 (>= 0.18) or 32-34 (<= 0.17)
    qw = rtn(out=2, inp=16, bits=3, gs=-1)
    for version, legacy in (("0.18.0", False), ("0.17.1", True)):
        path = one_module_checkpoint(tmp_path / version, qw, qcfg_overrides={"version": version}, legacy_packing=legacy)
        assert_same(dict(read_checkpoint(path))[DOWN], qw)
    path = one_module_checkpoint(tmp_path / "none", qw, qcfg_overrides={"version": None})
    with pytest.raises(CheckpointError, match="3-bit packing of 16 values is ambiguous"):
        list(read_checkpoint(path))
