"""GPTQ reader: round trips through real files, zero-point conventions, dynamic overrides, bad input."""

import warnings

import pytest
import torch
from checkpoint_writer import assert_same_weight, layer_tensors, random_weight, write_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

from quill.errors import CheckpointError, ConfigError, UnsupportedFormatError
from quill.formats.checkpoint import open_checkpoint, read_checkpoint
from quill.formats.packing import pack_int32, unpack_int32
from quill.formats.registry import QuillDeprecationWarning
from quill.writers.gptq import canonical_to_gptq


def gptq_config(bits=4, group_size=32, sym=True, desc_act=False, fmt=None, **extra):
    cfg = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym, "desc_act": desc_act}
    if fmt is not None:
        cfg["checkpoint_format"] = fmt
    return {**cfg, **extra}


def write_gptq(path, layers, cfg, v1=True, dense=None, **kw):
    tensors = layer_tensors(layers, canonical_to_gptq, v1=v1)
    tensors.update(dense or {})
    return write_checkpoint(path, tensors, cfg, **kw)


def read_all(path):
    return dict(read_checkpoint(path))


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([2, 3, 4, 8]), sym=st.booleans(), act_order=st.booleans(), v2=st.booleans(),
       gs=st.sampled_from([16, 32, -1]), k_blocks=st.integers(1, 3), out=st.sampled_from([8, 24, 32, 40]),
       bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_round_trip_through_files(tmp_path_factory, bits, sym, act_order, v2, gs, k_blocks, out, bias, seed):
    k = 32 * k_blocks
    qw = random_weight(out, k, bits, gs, sym, act_order, seed, bias)
    path = tmp_path_factory.mktemp("gptq")
    cfg = gptq_config(bits, gs, sym, act_order, "gptq_v2" if v2 else None)
    write_gptq(path, {"model.layers.0.mlp.down_proj": qw}, cfg, v1=not v2)
    (name, got), = read_checkpoint(path)
    assert name == "model.layers.0.mlp.down_proj"
    assert_same_weight(got, qw)
    assert torch.equal(got.dequantize(), qw.dequantize())


def test_v1_symmetric_stores_seven_and_reads_back_symmetric(tmp_path):
    qw = random_weight(16, 64, 4, 32, sym=True)
    t = canonical_to_gptq(qw, v1=True)
    assert (t["qzeros"] == 0x77777777).all()
    assert torch.equal(t["g_idx"], (torch.arange(64) // 32).to(torch.int32))
    write_checkpoint(tmp_path, {f"m.{s}": v for s, v in t.items()}, gptq_config())
    (_, got), = read_checkpoint(tmp_path)
    assert got.zeros is None and got.g_idx is None


def _autoround_v1_pack(zeros, bits):
    """auto-round's own writer (qlinear_torch_zp.pack_248_bits): sum of (zero - 1) << shift per word."""
    per = 32 // bits
    z = zeros.to(torch.int64).reshape(zeros.shape[0], -1, per) - 1
    words = (z << (torch.arange(per) * bits)).sum(-1)
    return ((words + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_v1_zero_of_zero_reads_back_exactly(tmp_path, bits):
    """A true zero of 0 is stored as 2**b - 1 with a borrow from the next field; GPTQModel's word add undoes both."""
    qw = random_weight(32, 64, bits, 32, sym=False, seed=3)
    zeros = qw.zeros.clone()
    zeros[0, 0], zeros[1, 0], zeros[7, 1] = 0, 0, 0  # fields 0 and 1 of one word, and a word's last field
    qw = qw.with_(zeros=zeros)
    t = canonical_to_gptq(qw, v1=True)
    assert torch.equal(t["qzeros"], _autoround_v1_pack(zeros.T.contiguous(), bits))
    stored = unpack_int32(t["qzeros"], bits, dim=1)
    assert int(stored[0, 0]) == (1 << bits) - 1  # the wrapped field the tools disagree on
    write_checkpoint(tmp_path, {f"m.{s}": v for s, v in t.items()}, gptq_config(bits, 32, sym=False))
    (_, got), = read_checkpoint(tmp_path)
    assert torch.equal(got.zeros, zeros)


def test_v1_three_bit_shifts_each_field(tmp_path):
    qw = random_weight(32, 64, 3, 32, sym=False, seed=5)
    zeros = qw.zeros.clone()
    zeros[0, 0] = 0
    t = canonical_to_gptq(qw.with_(zeros=zeros), v1=True)
    stored = unpack_int32(t["qzeros"], 3, dim=1, count=32)
    assert torch.equal(stored.T.to(torch.int16), (zeros - 1) % 8)
    write_checkpoint(tmp_path, {f"m.{s}": v for s, v in t.items()}, gptq_config(3, 32, sym=False))
    (_, got), = read_checkpoint(tmp_path)
    assert torch.equal(got.zeros, zeros)


def test_act_order_keeps_g_idx_and_trivial_g_idx_is_dropped(tmp_path):
    ao = random_weight(16, 128, 4, 32, sym=False, act_order=True, seed=1)
    plain = random_weight(16, 128, 4, 32, sym=False, seed=2)
    write_gptq(tmp_path, {"a": ao, "b": plain}, gptq_config(sym=False, desc_act=True))
    got = read_all(tmp_path)
    assert torch.equal(got["a"].g_idx, ao.g_idx) and got["b"].g_idx is None
    assert torch.equal(got["a"].dequantize(), ao.dequantize())


def test_desc_act_without_g_idx_is_refused(tmp_path):
    t = canonical_to_gptq(random_weight(16, 64), write_g_idx=False)
    write_checkpoint(tmp_path, {f"m.{s}": v for s, v in t.items()}, gptq_config(desc_act=True))
    with pytest.raises(CheckpointError, match=r"layer m: desc_act is true but tensor 'm.g_idx' is missing"):
        read_all(tmp_path)


def test_dynamic_overrides_and_skips(tmp_path):
    layers = {
        "model.layers.0.self_attn.q_proj": random_weight(32, 64, 8, 32, seed=1),  # bare regex -> 8 bit
        "model.layers.0.mlp.down_proj": random_weight(32, 64, 4, 16, sym=False, seed=2),  # +: group 16 asym
        "model.layers.1.mlp.down_proj": random_weight(32, 64, 4, 32, seed=3),  # global
    }
    dense = {"model.layers.0.mlp.gate.weight": torch.zeros(4, 64)}
    dynamic = {
        r"+:.*layers\.0\.mlp\.down_proj": {"group_size": 16, "sym": False},
        r".*layers\.0\.mlp\.down.*": {"bits": 8},  # also matches, but the first key wins
        r".*q_proj": {"bits": 8},
        r"-:.*mlp\.gate$": {},
    }
    write_gptq(tmp_path, layers, gptq_config(dynamic=dynamic), dense=dense)
    ckpt = open_checkpoint(tmp_path)
    got = dict(ckpt.quantized_layers())
    assert set(got) == set(layers)
    for name, qw in layers.items():
        assert_same_weight(got[name], qw)
    assert "model.layers.0.mlp.gate.weight" in dict(ckpt.dense_tensors())


def test_dynamic_skip_of_a_quantized_module_is_a_contradiction(tmp_path):
    write_gptq(tmp_path, {"model.layers.0.mlp.gate": random_weight(16, 64)},
               gptq_config(dynamic={r"-:.*mlp\.gate": {}}))
    with pytest.raises(ConfigError, match=r"layer model.layers.0.mlp.gate: stored quantized .*dynamic rule "
                                          r"'-:\.\*mlp\\\\.gate' skips it"):
        open_checkpoint(tmp_path)


def test_dynamic_bad_entries(tmp_path):
    write_gptq(tmp_path, {"m": random_weight(16, 64)}, gptq_config(dynamic={"+:(": {"bits": 8}}))
    with pytest.raises(ConfigError, match=r"dynamic: key '\(' is not a valid regular expression"):
        open_checkpoint(tmp_path)
    write_gptq(tmp_path, {"m": random_weight(16, 64)}, gptq_config(dynamic={"m": {"bits": 5}}))
    with pytest.raises(ConfigError, match=r"layer m: bits: bits=5 is not supported; supported: 2, 3, 4, 8"):
        open_checkpoint(tmp_path)
    write_gptq(tmp_path, {"m": random_weight(16, 64)}, gptq_config(dynamic={"m": {"group_size": "32"}}))
    with pytest.raises(ConfigError, match=r"dynamic\['m'\]\.group_size: expected int, found '32'"):
        open_checkpoint(tmp_path)


def test_lm_head_follows_the_lm_head_flag(tmp_path):
    head = random_weight(64, 32, 4, -1, seed=4)
    write_gptq(tmp_path / "a", {"lm_head": head}, gptq_config(lm_head=True))
    assert_same_weight(read_all(tmp_path / "a")["lm_head"], head)
    write_gptq(tmp_path / "b", {"lm_head": head}, gptq_config())
    with pytest.raises(ConfigError, match=r"layer lm_head: stored quantized .*lm_head is false"):
        open_checkpoint(tmp_path / "b")
    write_gptq(tmp_path / "c", {"m": head}, gptq_config(lm_head=True), dense={"lm_head.weight": torch.zeros(4, 4)})
    with pytest.raises(ConfigError, match=r"layer lm_head: quantization_config.lm_head is true, but the checkpoint "
                                          r"stores it unquantized"):
        open_checkpoint(tmp_path / "c")


def test_checkpoint_format_spellings(tmp_path):
    qw = random_weight(16, 64, 4, 32, sym=False, seed=6)
    write_gptq(tmp_path / "v2", {"m": qw}, gptq_config(sym=False, format="gptq_v2"), v1=False)
    assert_same_weight(read_all(tmp_path / "v2")["m"], qw)
    for bad, match in [({"checkpoint_format": "marlin"}, r"checkpoint_format: 'marlin' is not supported; "
                                                         r"supported: gptq, gptq_v2"),
                       ({"is_marlin_format": True}, r"is_marlin_format: Marlin-repacked"),
                       ({"pack_dtype": "int16"}, r"pack_dtype: 'int16' is not supported; supported: int32"),
                       ({"data_type": "mx_fp"}, r"data_type 'mx_fp' is not supported; supported: int"),
                       ({"rotation_config": {"block_size": 32}}, r"rotation_config: rotated")]:
        write_gptq(tmp_path / "bad", {"m": qw}, {**gptq_config(), **bad})
        with pytest.raises(UnsupportedFormatError, match=match):
            open_checkpoint(tmp_path / "bad")


def test_symmetric_config_with_asymmetric_zeros_is_refused(tmp_path):
    write_gptq(tmp_path, {"m": random_weight(16, 64, 4, 32, sym=False, seed=7)}, gptq_config(sym=True))
    with pytest.raises(ConfigError, match=r"layer m: the config says sym=true but 'm.qzeros' holds zero points"):
        read_all(tmp_path)


def test_standalone_quantize_config_json(tmp_path):
    qw = random_weight(16, 64, 4, 32, sym=False, seed=8)
    cfg = {k: v for k, v in gptq_config(sym=False).items() if k != "quant_method"}
    write_gptq(tmp_path, {"m": qw}, cfg, config_file="quantize_config.json")
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.quant_method == "gptq"
    assert_same_weight(dict(ckpt.quantized_layers())["m"], qw)


def test_deprecated_gptq_marlin_loads_with_a_warning(tmp_path):
    layers = {"m": random_weight(16, 64, 4, 32, seed=9)}
    write_gptq(tmp_path / "new", layers, gptq_config())
    write_gptq(tmp_path / "old", layers, gptq_config(quant_method="gptq_marlin"))
    with pytest.warns(QuillDeprecationWarning, match="'gptq_marlin' is deprecated"):
        old = read_all(tmp_path / "old")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = read_all(tmp_path / "new")
    assert torch.equal(old["m"].dequantize(), new["m"].dequantize())
    assert_same_weight(old["m"], new["m"])


# ---- bad input: typed errors naming the layer/tensor/field, what was found, what is supported ----

def _one_layer(tmp_path, cfg=None, mutate=None, qw=None):
    t = canonical_to_gptq(qw if qw is not None else random_weight(32, 64, 4, 32, sym=False, seed=11))
    if mutate:
        mutate(t)
    return write_checkpoint(tmp_path, {f"layer.{s}": v for s, v in t.items()}, cfg or gptq_config(sym=False))


def test_unknown_quant_method(tmp_path):
    _one_layer(tmp_path, gptq_config(quant_method="squeezellm"))
    with pytest.raises(UnsupportedFormatError, match=r"quant_method 'squeezellm' is not supported; supported: .*gptq"):
        open_checkpoint(tmp_path)


def test_unsupported_bits(tmp_path):
    _one_layer(tmp_path, gptq_config(bits=5))
    with pytest.raises(ConfigError, match=r"quantization_config.bits: bits=5 is not supported; supported: 2, 3, 4, 8"):
        open_checkpoint(tmp_path)


def test_missing_required_config_field(tmp_path):
    cfg = gptq_config()
    del cfg["group_size"]
    _one_layer(tmp_path, cfg)
    with pytest.raises(ConfigError, match=r"quantization_config: required field 'group_size' is missing"):
        open_checkpoint(tmp_path)


def test_group_size_not_dividing_in_features(tmp_path):
    _one_layer(tmp_path, gptq_config(group_size=48, sym=False))
    with pytest.raises(ConfigError, match=r"layer layer: group_size 48 does not divide in_features 64; supported"):
        read_all(tmp_path)


@pytest.mark.parametrize("tensor", ["qzeros", "scales", "qweight"])
def test_missing_tensor(tmp_path, tensor):
    _one_layer(tmp_path, mutate=lambda t: t.pop(tensor))
    if tensor == "qweight":
        with pytest.raises(CheckpointError, match=r"layer layer: tensor 'layer.qweight' is missing from the "
                                                  r"checkpoint, but \['layer.qzeros', 'layer.scales'\] are there"):
            open_checkpoint(tmp_path)
        return
    with pytest.raises(CheckpointError, match=rf"layer layer: tensor\(s\) \['layer.{tensor}'\] missing from the "
                                              r"checkpoint; GPTQ layers store qweight, qzeros, scales"):
        open_checkpoint(tmp_path)


def test_wrong_dtype(tmp_path):
    _one_layer(tmp_path, mutate=lambda t: t.update(qweight=t["qweight"].float()))
    with pytest.raises(CheckpointError, match=r"layer layer: tensor 'layer.qweight' has dtype torch.float32, "
                                              r"expected torch.int32"):
        read_all(tmp_path)


def test_wrong_shape(tmp_path):
    _one_layer(tmp_path, mutate=lambda t: t.update(scales=t["scales"][:, :8]))
    with pytest.raises(CheckpointError, match=r"tensor 'layer.scales' has shape \[2, 8\], expected \[\*, 32\]"):
        read_all(tmp_path)
    _one_layer(tmp_path, mutate=lambda t: t.update(g_idx=t["g_idx"][:40]))
    with pytest.raises(CheckpointError, match=r"'layer.qweight' has 8 rows, but g_idx gives in_features 40"):
        read_all(tmp_path)


def test_config_bits_contradict_qweight(tmp_path):
    _one_layer(tmp_path, gptq_config(bits=8, sym=False))
    with pytest.raises(CheckpointError, match=r"tensor 'layer.qzeros' has shape \[2, 4\], expected \[2, 8\] for 32 "
                                              r"values at bits=8 \(the tensor is shaped for bits=4\)"):
        read_all(tmp_path)


def test_config_group_size_contradicts_scales(tmp_path):
    _one_layer(tmp_path, gptq_config(group_size=16, sym=False))
    with pytest.raises(ConfigError, match=r"'layer.scales' has 2 groups but in_features 64 / group_size 16 = 4; the "
                                          r"config's group_size \(16\) contradicts the tensors"):
        read_all(tmp_path)


def test_unexpected_tensor_beside_qweight(tmp_path):
    _one_layer(tmp_path, mutate=lambda t: t.update(weight=torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['layer.weight'\] beside 'qweight'"):
        open_checkpoint(tmp_path)


def test_truncated_safetensors(tmp_path):
    _one_layer(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor '.*': truncated file: tensor ends at byte"):
        open_checkpoint(tmp_path)


def test_g_idx_out_of_range(tmp_path):
    bad = torch.arange(64, dtype=torch.int32) % 7  # groups 0..6, but only 2 exist
    _one_layer(tmp_path, gptq_config(sym=False, desc_act=True), mutate=lambda t: t.update(g_idx=bad))
    with pytest.raises(CheckpointError, match=r"layer: g_idx values span \[0, 6\], expected group indices in \[0, 2\)"):
        read_all(tmp_path)


def test_describe(tmp_path):
    _one_layer(tmp_path, gptq_config(sym=False, dynamic={"x": {"bits": 8}}))
    assert open_checkpoint(tmp_path).describe() == "gptq (v1 zeros), 4-bit, group 32, asym, dynamic overrides"


def test_packing_bits_match_the_documented_layout():
    """qweight packs 8 input columns per int32 along dim 0, lowest nibble first."""
    codes = torch.arange(16, dtype=torch.uint8).reshape(1, 16) % 16  # out=1, in=16
    qw = random_weight(1, 16, 4, 16).with_(codes=codes)
    t = canonical_to_gptq(qw)
    assert t["qweight"].shape == (2, 1) and int(t["qweight"][0, 0]) == 0x76543210
    assert torch.equal(t["qweight"], pack_int32(codes.T, 4, dim=0))
    assert t["g_idx"].tolist() == [0] * 16
