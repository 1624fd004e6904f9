"""Write small synthetic checkpoint directories (safetensors + config.json) for reader tests."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from quill.canonical import QuantizedWeight
from quill.writers.rtn import quantize_rtn


def write_checkpoint(path: Path, tensors: Mapping[str, torch.Tensor], quant_config: Mapping | None = None,
                     shards: int = 1, config_file: str | None = None) -> Path:
    """Save ``tensors`` (split into ``shards`` files with an index when > 1) and a config.json.

    ``config_file`` writes the quantization config into that stand-alone file instead
    of config.json's ``quantization_config`` (AutoGPTQ's quantize_config.json ...).
    """
    path.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(path / "model.safetensors"))
    else:
        weight_map = {}
        per = -(-len(names) // shards)
        for i in range(shards):
            part = names[i * per:(i + 1) * per]
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: tensors[n].contiguous() for n in part}, str(path / fname))
            weight_map.update({n: fname for n in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float16"}
    if quant_config is not None and config_file is None:
        config["quantization_config"] = dict(quant_config)
    elif quant_config is not None:
        (path / config_file).write_text(json.dumps(dict(quant_config)))
    (path / "config.json").write_text(json.dumps(config))
    return path


def layer_tensors(layers: Mapping[str, QuantizedWeight], writer: Callable[..., dict], **kw) -> dict:
    """``{module.suffix: tensor}`` for every layer through one format writer."""
    out = {}
    for module, qw in layers.items():
        out.update({f"{module}.{s}": t for s, t in writer(qw, **kw).items()})
    return out


def random_weight(out: int, inp: int, bits: int = 4, group_size: int = 32, sym: bool = True,
                  act_order: bool = False, seed: int = 0, bias: bool = False) -> QuantizedWeight:
    """A canonical weight quantized from a random float matrix (scales float16)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.02
    qw = quantize_rtn(w, bits, group_size, sym, act_order, generator=g)
    if bias:
        qw = qw.with_(bias=(torch.randn(out, generator=g) * 0.1).to(torch.float16))
    return qw


def canonical(qw: QuantizedWeight) -> QuantizedWeight:
    """The form a reader returns: zeros None when all equal 2**(bits-1), trivial g_idx dropped."""
    zeros, g_idx = qw.zeros, qw.g_idx
    if zeros is not None and bool((zeros == (1 << (qw.bits - 1))).all()):
        zeros = None
    if g_idx is not None and torch.equal(g_idx.long(), torch.arange(qw.in_features) // qw.group_size):
        g_idx = None
    return qw.with_(zeros=zeros, g_idx=g_idx)


def assert_same_weight(got: QuantizedWeight, want: QuantizedWeight) -> None:
    """Identical codes, scales (values and dtype), zeros, g_idx, bias and shape facts."""
    want = canonical(want)
    assert (got.bits, got.group_size) == (want.bits, want.group_size)
    assert torch.equal(got.codes, want.codes)
    assert got.scales.dtype == want.scales.dtype and torch.equal(got.scales, want.scales)
    for field in ("zeros", "g_idx", "bias"):
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), field
