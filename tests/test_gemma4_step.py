"""Gemma 4 in the one-call native decode step (quill.layers.native_step; csrc/step.cpp, step_attn.h, step_ple.h):
per-layer input embeddings, layer scalars, the weightless value norm, global layers with their own head size and KV
head count, values taken from the keys, proportional rope and KV-shared layers (reading earlier layers' pools,
writing none) give the Python layers' bits -- greedy tokens and top-3 log-probabilities of batched sequences of
different lengths past the local window, arriving at different steps, teamed on 2 threads and op by op -- on this
CPU's kernels, the AVX2 ones (``isa="avx2"``) and the scalar twins, with dense (bfloat16-valued) weights and
llama.cpp's Q8_0 / Q4_0 files at float and int8 activations; the MoE variant (routed experts beside every MLP: the
scaled router, per-expert scales, the branches' own norms, gelu-tanh experts as one native ExpertGroup) too;
`quill inspect` and the load log say the step runs; a model whose experts cannot run natively says why."""

from __future__ import annotations

import logging

import pytest
import torch

import quill
from quill import native
from quill.cli.inspect import report
from quill.engine.core import EngineConfig, EngineCore
from quill.platform import detect
from tests.engine_util import staggered
from tests.gemma4_util import hf_gemma4
from tests.model_util import save_hf_dir
from tests.test_gemma4 import PROMPT
from tests.test_gemma4_gguf import converted  # noqa: F401  (llama.cpp's files, a module fixture)

pytestmark = pytest.mark.skipif(native.load().module is None, reason="native kernels not built")
HAS_AVX512 = detect().has("avx512f")


def step_run(llm, native_step: bool, isa: str, team: bool = True, kv_cache_dtype: str = "float32") -> dict:
    """request -> (greedy tokens, top-3 log-probabilities per token): three sequences of 5, 11 and 17 tokens, 24
    tokens each (past the local layers' window of 16), arriving at steps 0, 0 and 3, through a fresh engine on
    decode attention variant ``isa``."""
    c = EngineCore(llm.model, llm.eos_token_ids, llm.context_length,
                   EngineConfig(kv_cache_dtype=kv_cache_dtype, block_size=8, native_step=native_step, max_num_seqs=4,
                                max_num_batched_tokens=32), isa=isa)
    assert (c.native_step is not None) == native_step, c.native_step_reason
    if native_step:
        c.native_step.team = team
    params = quill.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [[t % llm.model.args.vocab_size for t in PROMPT[i * 7:i * 7 + 5 + 6 * i]] for i in range(3)]
    return staggered(c, prompts, params, {0: [0, 1], 3: [2]})


def same_bits(llm, isa: str | None = None, **kw) -> None:
    """Step on (teamed, then op by op) = step off, bit for bit."""
    isa = isa or llm.engine.cache.isa
    python = step_run(llm, False, isa, **kw)
    assert step_run(llm, True, isa, **kw) == python
    assert step_run(llm, True, isa, team=False, **kw) == python
    assert len(python) == 3 and all(len(t) == 24 for t, _ in python.values())
    assert len({tuple(t) for t, _ in python.values()}) > 1  # (the sequences differ)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_hf_dir(hf_gemma4(seed=1), tmp_path_factory.mktemp("gemma4_step"), tokenizer=False)


@pytest.fixture(scope="module")
def dense(saved):
    return quill.LLM(str(saved), skip_tokenizer_init=True, kv_cache_dtype="float32", threads=2)


def test_the_native_step_runs_gemma4(saved, caplog):
    with caplog.at_level(logging.INFO, logger="quill"):
        llm = quill.LLM(str(saved), skip_tokenizer_init=True, kv_cache_dtype="float32", threads=2)
    assert llm.model.native_refusal() is None
    step = llm.engine.native_step
    assert step is not None, llm.engine.native_step_reason
    assert step.handle.num_layers == 6 and step.tables == ("local", "global")
    assert "decode step: native: every decoder layer in one call" in report(llm)
    assert any("native decode step: 6 decoder layers in one call" in r.getMessage() for r in caplog.records)
    specs = llm.model.decoder_layer_specs()
    assert [s.attention.kv_source for s in specs] == [None] * 4 + [2, 3]
    assert [s.per_layer_input.index for s in specs] == list(range(6))


@pytest.mark.parametrize("isa", ["native", "scalar"])
def test_the_native_step_gives_the_python_layers_bits(dense, isa):
    """This CPU's kernels and decode attention, and the scalar twin of decode attention."""
    same_bits(dense, None if isa == "native" else isa)


@pytest.mark.skipif(not HAS_AVX512, reason="the AVX2 variant is this CPU's own: tested above")
def test_the_avx2_variant_gives_the_python_layers_bits(saved):
    """Every native kernel on its AVX2 variant (what an AVX2-only CPU runs)."""
    llm = quill.LLM(str(saved), skip_tokenizer_init=True, kv_cache_dtype="float32", threads=2, isa="avx2")
    assert llm.engine.cache.isa == "avx2"
    same_bits(llm)


def test_a_16_bit_kv_cache(dense):
    same_bits(dense, kv_cache_dtype="bfloat16")


@pytest.mark.parametrize("variant", ["own values, no PLE, no sharing", "one layer, shared over two"])
def test_other_configs_give_the_python_layers_bits(tmp_path, variant):
    """Global layers with a v_proj and the local layers' KV head count, no per-layer inputs, no KV sharing; and
    a source layer read by two KV-shared layers (double-wide MLPs, their own intermediate size)."""
    L, G = "sliding_attention", "full_attention"
    kw = (dict(attention_k_eq_v=False, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
               use_double_wide_mlp=False) if variant.startswith("own") else
          dict(num_hidden_layers=5, layer_types=[L, G, L, L, G], num_kv_shared_layers=3))
    d = save_hf_dir(hf_gemma4(seed=3, **kw), tmp_path / "ckpt", tokenizer=False)
    llm = quill.LLM(str(d), skip_tokenizer_init=True, kv_cache_dtype="float32", threads=2)
    assert llm.engine.native_step is not None, llm.engine.native_step_reason
    same_bits(llm)


@pytest.mark.parametrize("activation", ["none", "int8", "int8-group"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_gguf_files_give_the_python_layers_bits(converted, qtype, activation):  # noqa: F811
    """llama.cpp's files (global heads 64 wide, values from the keys, KV-shared layers), every linear on a
    quantized native kernel, float and int8 activations."""
    _, files = converted
    llm = quill.LLM(str(files[qtype]), skip_tokenizer_init=True, kv_cache_dtype="float32", threads=2,
                    activation_quant=activation)
    assert llm.engine.native_step is not None, llm.engine.native_step_reason
    same_bits(llm)


@pytest.fixture(scope="module")
def moe_saved(tmp_path_factory):
    hf = hf_gemma4(seed=5, enable_moe_block=True, num_experts=5, top_k_experts=2, moe_intermediate_size=20)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("router.scale", "per_expert_scale")):
                p.copy_(torch.rand_like(p) + 0.5)
    return save_hf_dir(hf, tmp_path_factory.mktemp("gemma4_moe_step"), tokenizer=False)


@pytest.mark.parametrize("isa", ["native", "avx2", "scalar"])
def test_the_moe_variant_gives_the_python_layers_bits(moe_saved, isa):
    """Router, top-k, per-expert scales and the experts beside each dense MLP (with PLE and KV sharing), on this
    CPU's kernels, every kernel's AVX2 variant, and the scalar decode attention."""
    if isa == "avx2" and not HAS_AVX512:
        pytest.skip("the AVX2 variant is this CPU's own: tested as native")
    llm = quill.LLM(str(moe_saved), skip_tokenizer_init=True, kv_cache_dtype="float32", threads=2,
                    **({"isa": "avx2"} if isa == "avx2" else {}))
    assert llm.engine.native_step is not None, llm.engine.native_step_reason
    assert llm.model.decoder_layer_specs()[0].experts_beside.moe.native_group is not None
    same_bits(llm, "scalar" if isa == "scalar" else None)


def test_experts_that_cannot_run_natively_say_why(moe_saved):
    llm = quill.LLM(str(moe_saved), skip_tokenizer_init=True, kv_cache_dtype="float32", moe_backend="reference")
    why = llm.engine.native_step_reason
    assert llm.engine.native_step is None and llm.model.native_refusal() is None
    assert why == "layer 0: model.layers.0.moe: the routed experts do not run as one native expert group"
    assert why in report(llm)


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    from tests.test_gemma4_gguf import moe_gguf

    return moe_gguf(tmp_path_factory.mktemp("gemma4_moe_gguf") / "hf")[1]


@pytest.mark.parametrize("activation", ["none", "int8-group"])
def test_the_moe_variant_from_gguf_gives_the_python_layers_bits(moe_gguf, activation):
    """llama.cpp's Q8_0 file of the MoE variant (experts stacked as ffn_gate_up_exps, quantized): the experts one
    native group on quantized kernels, float and int8 activations."""
    llm = quill.LLM(str(moe_gguf), skip_tokenizer_init=True, kv_cache_dtype="float32", threads=2,
                    activation_quant=activation)
    assert llm.engine.native_step is not None, llm.engine.native_step_reason
    assert llm.model.decoder_layer_specs()[0].experts_beside.moe.native_group is not None
    same_bits(llm)
