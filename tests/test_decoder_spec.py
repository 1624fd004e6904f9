"""Decoder layers described as data (quill.layers.decoder) and the native decode step built from those
descriptions alone (quill.layers.native_step): every architecture describes what its layers compute; what
the step cannot run is refused naming the layer and the reason, in the engine, `quill inspect` and the
load log.  (That the step gives the Python layers' bits: tests/test_native_step.py.)"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import quill
from quill import native
from quill.cli.inspect import report
from quill.engine.kv_cache import PagedKVCache
from quill.layers import DecoderLayerSpec, MLPSpec, MoESpec, build_native_step
from quill.models import model_module, supported_model_types
from quill.models.base import DecoderLM
from tests.fixture_util import fixture_path
from tests.model_util import ARCH_EXTRA, BASE, save_hf_dir
from tests.moe_models_util import MOE_EXTRA, hf_moe_model

needs_native = pytest.mark.skipif(native.load().module is None, reason="native kernels not built")

# per architecture (the tiny configs of tests/model_util.py and moe_models_util.py): each layer's feed-forward
# block ("mlp", "moe", "moe+shared") and whether attention has q/k norms and q/k/v biases
EXPECTED = {
    "llama": (["mlp", "mlp"], False, False),
    "mistral": (["mlp", "mlp"], False, False),
    "qwen2": (["mlp", "mlp"], False, True),
    "qwen3": (["mlp", "mlp"], True, False),
    "mixtral": (["moe", "moe"], False, False),
    "qwen2_moe": (["moe+shared", "mlp", "moe+shared"], False, True),
    "qwen3_moe": (["mlp", "moe", "mlp", "moe"], True, False),
}


def unloaded(model_type: str) -> DecoderLM:
    """A tiny model of ``model_type``, built (its slots empty): its structure, no weights."""
    config = {**BASE, **ARCH_EXTRA.get(model_type, {}), **MOE_EXTRA.get(model_type, {}), "model_type": model_type}
    module = model_module(model_type)
    return module.Model(module.ModelArgs.from_dict(config))


def ffn_kind(spec: DecoderLayerSpec) -> str:
    if isinstance(spec.ffn, MLPSpec):
        return "mlp"
    return "moe+shared" if spec.ffn.shared_expert is not None else "moe"


# architectures whose layers are not pre-norm attention + MLP: their own test files check their descriptions
DESCRIBED_ELSEWHERE = {
    "gemma3": "tests/test_gemma3.py", "gemma3_text": "tests/test_gemma3.py",  # sandwich norms, local layers
    "gemma4": "tests/test_gemma4.py", "gemma4_text": "tests/test_gemma4.py",  # per-layer inputs, KV-shared layers
    "qwen3_5": "tests/test_qwen3_5.py", "qwen3_5_text": "tests/test_qwen3_5.py",  # recurrent layers
    "qwen3_5_moe": "tests/test_qwen3_5.py", "qwen3_5_moe_text": "tests/test_qwen3_5.py",
    "gpt_oss": "tests/test_gpt_oss.py",  # attention sinks, biased router and clamped-SwiGLU experts
}


def test_every_architecture_is_covered():
    assert sorted({*EXPECTED, *DESCRIBED_ELSEWHERE}) == supported_model_types()


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_every_architecture_describes_its_decoder_layers(model_type):
    model = unloaded(model_type)
    args, specs = model.args, model.decoder_layer_specs()
    kinds, qk_norms, qkv_bias = EXPECTED[model_type]
    assert [ffn_kind(s) for s in specs] == kinds
    for layer, s in zip(model.model.layers, specs):
        a = s.attention
        assert s.residual == "pre-norm" and s.input_norm is layer.input_layernorm
        assert (a.heads, a.kv_heads, a.head_dim, a.scale) == (args.num_attention_heads, args.num_key_value_heads,
                                                              args.head_dim, args.head_dim ** -0.5)
        assert a.qkv.names == ("q_proj", "k_proj", "v_proj") and a.qkv.group is layer.self_attn.qkv
        assert (a.q_norm is not None, a.k_norm is not None) == (qk_norms, qk_norms)
        assert (a.qkv_bias, a.o_bias) == (qkv_bias, False)
        if isinstance(s.ffn, MLPSpec):
            assert s.ffn.gate_up.names == ("gate_proj", "up_proj") and s.ffn.activation == "silu"
            assert s.ffn.intermediate == args.intermediate_size
        else:
            assert (s.ffn.router_kind, s.ffn.top_k) == ("softmax-top-k", args.num_experts_per_tok)
            assert s.ffn.renormalize == (model_type == "mixtral" or args.norm_topk_prob)
            assert s.ffn.native_group is None  # nothing loaded, no experts built


def test_a_shared_expert_is_described_with_its_own_mlp():
    s = unloaded("qwen2_moe").decoder_layer_specs()[0].ffn
    assert isinstance(s, MoESpec) and s.name == "model.layers.0.mlp"
    assert s.shared_expert.intermediate == MOE_EXTRA["qwen2_moe"]["shared_expert_intermediate_size"]
    assert s.shared_gate.out_features == 1


@needs_native
def test_an_architecture_the_step_cannot_run_says_why_everywhere(tmp_path, caplog):
    """Qwen2-MoE with float32 weights (its linears on torch's dense kernel, not a native one): the engine keeps
    the Python layers, and the reason names the layer in the engine, `quill inspect` and one line of the load
    log.  (Its shared expert runs in the step: tests/test_qwen3_5.py's MoE.)"""
    d = save_hf_dir(hf_moe_model("qwen2_moe", seed=2), tmp_path / "qwen2moe", tokenizer=False)
    with caplog.at_level(logging.INFO, logger="quill.layers"):
        llm = quill.LLM(str(d), skip_tokenizer_init=True, cache=False)
    reason = "layer 0: q_proj+k_proj+v_proj runs kernel dense, not a native one"
    assert llm.engine.native_step is None and llm.engine.native_step_reason == reason
    assert f"decode step: the model's Python layers ({reason})\n" in report(llm)
    logged = [r.getMessage() for r in caplog.records if r.name == "quill.layers"]
    assert logged == [f"native decode step: not built, the Python layers run ({reason})"]


@needs_native
def test_a_built_step_is_logged_once(caplog):
    with caplog.at_level(logging.INFO, logger="quill.layers"):
        llm = quill.LLM(str(fixture_path("ct-w4a16-sym-g128-llama")), skip_tokenizer_init=True, cache=False)
    n = llm.model.args.num_hidden_layers
    assert llm.engine.native_step is not None
    assert [r.getMessage() for r in caplog.records if r.name == "quill.layers"] == [
        f"native decode step: {n} decoder layers in one call"]


@pytest.fixture(scope="module")
def llama():
    if native.load().module is None:
        pytest.skip("native kernels not built")
    return quill.LLM(str(fixture_path("ct-w4a16-sym-g128-llama")), skip_tokenizer_init=True, cache=False)


def with_layer(specs: list[DecoderLayerSpec], i: int, **changes) -> list[DecoderLayerSpec]:
    out = list(specs)
    out[i] = dataclasses.replace(out[i], **changes)
    return out


def test_the_step_reads_only_the_descriptions(llama):
    """Descriptions of what the step does not compute are refused, naming the layer; the model's own
    description builds the step."""
    specs, pools = llama.model.decoder_layer_specs(), llama.engine.cache
    assert len(specs) >= 2
    step, why = build_native_step(specs, torch.float32, pools)
    assert why is None and step.handle.num_layers == len(specs)
    attn, ffn = specs[1].attention, specs[0].ffn
    cases = {
        "layer 1: residual structure 'parallel' (the step runs 'pre-norm' and 'sandwich-norm')":
            with_layer(specs, 1, residual="parallel"),
        "layer 0: feed-forward activation 'gelu' (the step runs silu, gelu_pytorch_tanh)":
            with_layer(specs, 0, ffn=dataclasses.replace(ffn, activation="gelu")),
        "layer 1: a q norm without a k norm, or a k norm without a q norm (the step runs both or neither)":
            with_layer(specs, 1, attention=dataclasses.replace(attn, q_norm=specs[1].input_norm)),
        "layer 1: hidden size, heads or scale differ from layer 0's (one set per step)":
            with_layer(specs, 1, attention=dataclasses.replace(attn, scale=attn.scale * 2)),
        "layer 1: model.layers.1.mlp: router 'sigmoid' (the step runs 'softmax-top-k')":
            with_layer(specs, 1, ffn=MoESpec("model.layers.1.mlp", attn.o_proj, "sigmoid", 2, True, None)),
    }
    for reason, described in cases.items():
        assert build_native_step(described, torch.float32, pools) == (None, reason)
    assert build_native_step(None, torch.float32, pools, "NewModel") == (
        None, "NewModel does not describe its decoder layers")
    assert build_native_step(specs, torch.float16, pools) == (None, "compute dtype torch.float16 (the step runs "
                                                                    "float32)")
    torch_pools = PagedKVCache(len(specs), 2, 16, attn.kv_heads, attn.head_dim, isa=None)
    assert build_native_step(specs, torch.float32, torch_pools) == (None, "decode attention runs in torch")


def test_a_model_that_describes_nothing_keeps_its_python_layers(llama):
    """The base class's answer for a new architecture that has not described its layers."""

    class NewModel(DecoderLM):
        def __init__(self):
            super().__init__()
            self.dtype = torch.float32

    assert NewModel().native_decode_step(llama.engine.cache) == (None, "NewModel does not describe its decoder "
                                                                       "layers")
