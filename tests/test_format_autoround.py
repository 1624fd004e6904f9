"""AutoRound reader: packing formats over the shared GPTQ/AWQ converters, extra_config, blocks, bad input."""

import warnings

import pytest
import torch
from checkpoint_writer import assert_same_weight, layer_tensors, random_weight, write_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

from quill.errors import CheckpointError, ConfigError, UnsupportedFormatError
from quill.formats.autoround import PACKING_FORMATS
from quill.formats.checkpoint import open_checkpoint, read_checkpoint
from quill.formats.registry import QuillDeprecationWarning
from quill.writers.awq import canonical_to_awq
from quill.writers.gptq import canonical_to_gptq


def ar_config(bits=4, group_size=32, sym=True, packing="auto_round:auto_gptq", **extra):
    return {"quant_method": "auto-round", "bits": bits, "group_size": group_size, "sym": sym, "data_type": "int",
            "packing_format": packing, "block_name_to_quantize": "model.layers", **extra}


def writer_for(packing):
    layout, v1 = PACKING_FORMATS.get(packing, ("gptq", True))  # unknown packings: GPTQ tensors, refused by config
    if layout == "awq":
        return canonical_to_awq, {}
    return canonical_to_gptq, {"v1": v1}


def write_ar(path, layers, cfg, dense=None, **kw):
    writer, kwargs = writer_for(cfg.get("packing_format", "auto_round:auto_gptq"))
    tensors = layer_tensors(layers, writer, **kwargs)
    tensors.update(dense or {})
    return write_checkpoint(path, tensors, cfg, **kw)


def read_all(path):
    return dict(read_checkpoint(path))


GPTQ_PACKINGS = [p for p, (layout, _) in PACKING_FORMATS.items() if layout == "gptq"]
AWQ_PACKINGS = [p for p, (layout, _) in PACKING_FORMATS.items() if layout == "awq"]


@settings(max_examples=40, deadline=None)
@given(packing=st.sampled_from(GPTQ_PACKINGS), bits=st.sampled_from([2, 3, 4, 8]), sym=st.booleans(),
       gs=st.sampled_from([32, -1]), bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_gptq_packings_round_trip(tmp_path_factory, packing, bits, sym, gs, bias, seed):
    qw = random_weight(32, 64, bits, gs, sym, False, seed, bias)
    path = tmp_path_factory.mktemp("ar")
    write_ar(path, {"model.layers.0.mlp.up_proj": qw}, ar_config(bits, gs, sym, packing))
    (_, got), = read_checkpoint(path)
    assert_same_weight(got, qw)


@settings(max_examples=20, deadline=None)
@given(packing=st.sampled_from(AWQ_PACKINGS), sym=st.booleans(), gs=st.sampled_from([32, 64, -1]),
       seed=st.integers(0, 2**31 - 1))
def test_awq_packings_round_trip(tmp_path_factory, packing, sym, gs, seed):
    qw = random_weight(24, 128, 4, gs, sym, False, seed)
    path = tmp_path_factory.mktemp("ar")
    write_ar(path, {"model.layers.1.self_attn.o_proj": qw}, ar_config(4, gs, sym, packing))
    (_, got), = read_checkpoint(path)
    assert_same_weight(got, qw)


def test_default_packing_is_gptq_v1_and_asym_auto_round_stores_true_zeros(tmp_path):
    qw = random_weight(32, 64, 4, 32, sym=False, seed=1)
    cfg = ar_config(sym=False)
    del cfg["packing_format"]
    write_ar(tmp_path / "v1", {"model.layers.0.x": qw}, cfg)
    assert_same_weight(read_all(tmp_path / "v1")["model.layers.0.x"], qw)
    # "auto_round" packing keeps true zeros: reading it as v1 would be off by one
    write_ar(tmp_path / "v2", {"model.layers.0.x": qw}, ar_config(sym=False, packing="auto_round"))
    got = read_all(tmp_path / "v2")["model.layers.0.x"]
    assert torch.equal(got.zeros, qw.zeros)


def test_extra_config_exact_then_regex_and_bits16_dense(tmp_path):
    layers = {
        "model.layers.0.self_attn.q_proj": random_weight(32, 64, 8, 32, seed=2),  # exact: 8 bit
        "model.layers.0.mlp.down_proj": random_weight(32, 64, 8, 16, seed=3),  # regex: 8 bit, group 16
        "model.layers.1.mlp.down_proj": random_weight(32, 64, 4, 16, sym=False, seed=4),  # exact beats regex
        "model.layers.1.mlp.up_proj": random_weight(32, 64, 4, 32, seed=5),  # global
    }
    dense = {"model.layers.1.mlp.gate_proj.weight": torch.zeros(32, 64),  # bits 16
             "model.layers.1.mlp.gate.weight": torch.zeros(4, 64)}  # an exact name that is also a prefix
    extra = {
        "model.layers.0.self_attn.q_proj": {"bits": 8},
        r".*mlp\.down_proj": {"bits": 8, "group_size": 16},
        "model.layers.1.mlp.down_proj": {"group_size": 16, "sym": False},
        "model.layers.1.mlp.gate_proj": {"bits": 16, "data_type": "float"},
        "model.layers.1.mlp.gate": {"bits": 16},  # exact module name: must not act as a regex on gate_proj
        "unused.regex.*": {},
    }
    write_ar(tmp_path, layers, ar_config(extra_config=extra), dense=dense)
    ckpt = open_checkpoint(tmp_path)
    got = dict(ckpt.quantized_layers())
    assert set(got) == set(layers)
    for name, qw in layers.items():
        assert_same_weight(got[name], qw)
    assert set(dense) <= set(dict(ckpt.dense_tensors()))
    assert ckpt.describe() == "auto-round (auto_round:auto_gptq), 4-bit, group 32, sym, 6 extra_config entries"


@pytest.mark.parametrize("blocks", ["model.layers", "model.layers,mtp.layers", ["model.layers"],
                                    [["model.layers.0", "model.layers.1"]]])
def test_block_names_spellings(tmp_path, blocks):
    layers = {"model.layers.0.mlp.up_proj": random_weight(32, 64, seed=6),
              "model.layers.1.mlp.up_proj": random_weight(32, 64, seed=7)}
    cfg = ar_config()
    del cfg["block_name_to_quantize"]
    write_ar(tmp_path, layers, {**cfg, "to_quant_block_names": blocks})
    assert set(read_all(tmp_path)) == set(layers)


def test_layer_outside_blocks_needs_extra_config(tmp_path):
    head = random_weight(64, 32, 4, 32, seed=8)
    write_ar(tmp_path / "ok", {"lm_head": head}, ar_config(extra_config={"lm_head": {"bits": 4}}))
    assert_same_weight(read_all(tmp_path / "ok")["lm_head"], head)
    write_ar(tmp_path / "head", {"lm_head": head}, ar_config())
    with pytest.raises(ConfigError, match=r"layer lm_head: stored quantized .*extra_config does not list it"):
        open_checkpoint(tmp_path / "head")
    write_ar(tmp_path / "vis", {"visual.proj": head}, ar_config())
    with pytest.raises(ConfigError, match=r"layer visual.proj: stored quantized .*outside block_name_to_quantize "
                                          r"\['model.layers'\]"):
        open_checkpoint(tmp_path / "vis")
    write_ar(tmp_path / "dense", {"model.layers.0.q": head}, ar_config(extra_config={"lm_head": {"bits": 4}}),
             dense={"lm_head.weight": torch.zeros(8, 32)})
    with pytest.raises(ConfigError, match=r"layer lm_head: quantization_config.extra_config\['lm_head'\] quantizes "
                                          r"it, but the checkpoint stores it unquantized"):
        open_checkpoint(tmp_path / "dense")


def test_extra_config_bits16_on_a_quantized_module_is_a_contradiction(tmp_path):
    write_ar(tmp_path, {"model.layers.0.mlp.up_proj": random_weight(32, 64)},
             ar_config(extra_config={r".*up_proj": {"bits": 16}}))
    with pytest.raises(ConfigError, match=r"layer model.layers.0.mlp.up_proj: stored quantized .*extra_config"
                                          r"\['\.\*up_proj'\] sets bits=16"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("method", ["inc", "intel/auto-round", "auto_round"])
def test_aliases_and_deprecated_inc(tmp_path, method):
    layers = {"model.layers.0.x": random_weight(32, 64, seed=9)}
    write_ar(tmp_path / "new", layers, ar_config())
    write_ar(tmp_path / "old", layers, ar_config(quant_method=method))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = read_all(tmp_path / "old")
    deprecated = [w for w in caught if issubclass(w.category, QuillDeprecationWarning)]
    assert len(deprecated) == (1 if method == "inc" else 0)
    assert_same_weight(old["model.layers.0.x"], read_all(tmp_path / "new")["model.layers.0.x"])


# ---- bad input -----------------------------------------------------------------------

@pytest.mark.parametrize("bad,match", [
    ({"packing_format": "auto_round:llm_compressor"}, r"packing_format: 'auto_round:llm_compressor' is not supported;"
                                                      r" supported: auto_round:auto_gptq, .*auto_round:auto_awq"),
    ({"packing_format": "auto_round:fp8_static"}, r"'auto_round:fp8_static' is not supported"),
    ({"data_type": "mx_fp"}, r"quantization_config.data_type: data_type 'mx_fp' is not supported; supported: int"),
    ({"act_bits": 8}, r"quantization_config.act_bits: 8 \(quantized activations\) is not supported"),
    ({"bits": 5}, r"quantization_config.bits: bits=5 is not supported with packing_format 'auto_round:auto_gptq'; "
                  r"supported: 2, 3, 4, 8"),
    ({"bits": 8, "packing_format": "auto_round:auto_awq"}, r"bits=8 is not supported with packing_format "
                                                           r"'auto_round:auto_awq'; supported: 4"),
])
def test_unsupported_configs(tmp_path, bad, match):
    write_ar(tmp_path, {"model.layers.0.x": random_weight(32, 64)}, {**ar_config(), **bad})
    with pytest.raises(UnsupportedFormatError, match=match):
        open_checkpoint(tmp_path)


def test_per_layer_unsupported_override(tmp_path):
    write_ar(tmp_path, {"model.layers.0.x": random_weight(32, 64)},
             ar_config(packing="auto_round:auto_awq", extra_config={"model.layers.0.x": {"bits": 8}}))
    with pytest.raises(UnsupportedFormatError, match=r"layer model.layers.0.x \(quantization_config.extra_config"
                                                     r"\['model.layers.0.x'\]\): bits=8 is not supported"):
        open_checkpoint(tmp_path)
    write_ar(tmp_path, {"model.layers.0.x": random_weight(32, 64)},
             ar_config(extra_config={"model.layers.0.x": {"data_type": "nv_fp"}}))
    with pytest.raises(UnsupportedFormatError, match=r"extra_config\['model.layers.0.x'\].data_type: data_type "
                                                     r"'nv_fp' is not supported"):
        open_checkpoint(tmp_path)


def test_bad_config_shapes(tmp_path):
    for bad, match in [({"extra_config": ["x"]}, r"extra_config: expected an object mapping layer names"),
                       ({"extra_config": {"model.layers.0.x": 8}}, r"extra_config\['model.layers.0.x'\]: expected "
                                                                   r"an object of overrides, found 8"),
                       ({"block_name_to_quantize": 3}, r"block_name_to_quantize: expected a comma-separated string"),
                       ({"extra_config": {"(": {"bits": 8}}}, r"extra_config: key '\(' is not a valid regular")]:
        write_ar(tmp_path, {"model.layers.0.x": random_weight(32, 64)}, {**ar_config(), **bad})
        with pytest.raises(ConfigError, match=match):
            open_checkpoint(tmp_path)


def test_config_contradicting_tensors(tmp_path):
    write_ar(tmp_path, {"model.layers.0.x": random_weight(32, 64, 4, 32)}, ar_config(bits=8))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.x.qzeros' has shape \[2, 4\], expected \[2, 8\] .*"
                                              r"shaped for bits=4"):
        read_all(tmp_path)
    write_ar(tmp_path, {"model.layers.0.x": random_weight(32, 64, 4, 32)}, ar_config(group_size=64))
    with pytest.raises(ConfigError, match=r"'model.layers.0.x.scales' has 2 groups but in_features 64 / group_size "
                                          r"64 = 1"):
        read_all(tmp_path)


def test_missing_and_truncated(tmp_path):
    t = canonical_to_awq(random_weight(32, 64))
    del t["scales"]
    write_checkpoint(tmp_path, {f"model.layers.0.x.{s}": v for s, v in t.items()},
                     ar_config(packing="auto_round:auto_awq"))
    with pytest.raises(CheckpointError, match=r"\['model.layers.0.x.scales'\] missing from the checkpoint; "
                                              r"AutoRound \(auto_round:auto_awq\) layers store qweight, qzeros"):
        open_checkpoint(tmp_path)
    write_ar(tmp_path, {"model.layers.0.x": random_weight(32, 64)}, ar_config())
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:20])
    with pytest.raises(CheckpointError, match=r"truncated or corrupt safetensors file"):
        open_checkpoint(tmp_path)


def test_standalone_quantization_config_json(tmp_path):
    qw = random_weight(32, 64, seed=10)
    write_ar(tmp_path, {"model.layers.0.x": qw}, ar_config(), config_file="quantization_config.json")
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.quant_method == "auto-round"
    assert_same_weight(dict(ckpt.quantized_layers())["model.layers.0.x"], qw)
