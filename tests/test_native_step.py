"""The native decode step (quill.layers.native_step, quill/native/csrc/step.cpp): every decoder layer of
an all-decode step in one call gives the Python layers' bits (tokens and log-probabilities, batched
sequences of different lengths arriving at different steps), on every dense real-tool fixture, the
default model, int8 activations and q/k/v that cannot share a kernel; models it cannot run say why;
bad inputs are named errors."""

from __future__ import annotations

import pytest
import torch

import quill
import quill.default_model as default_model
from quill import native
from quill.engine.core import EngineConfig, EngineCore
from quill.errors import KernelError
from quill.options import DtypeNotOfferedWarning
from quill.platform import detect
from tests.engine_util import staggered
from tests.fixture_util import fixture_path
from tests.llamacpp_util import quantize
from tests.test_fixture_models import DENSE
from tests.test_moe_fixtures import MOE

pytestmark = pytest.mark.skipif(native.load().module is None, reason="native kernels not built")
PLATFORM = detect()

PROMPTS = [[5, 17, 99, 42, 8], list(range(20, 57)), [7] * 3, list(range(100, 119)), [250, 3, 9, 77, 31, 64, 12]]
ARRIVALS = {0: [0, 1], 2: [2], 5: [3], 9: [4]}  # step -> prompts arriving then


def run(llm, native_step: bool, max_tokens: int = 10, prompts=PROMPTS, team: bool = True,
        kv_cache_dtype: str = "auto") -> dict:
    """request -> (tokens, top-3 log-probabilities per token) from a fresh engine over ``llm``'s model."""
    core = EngineCore(llm.model, llm.eos_token_ids, llm.context_length,
                      EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, native_step=native_step,
                                   kv_cache_dtype=kv_cache_dtype),
                      isa=llm.engine.cache.isa)
    assert (core.native_step is not None) == native_step, core.native_step_reason
    if native_step:
        core.native_step.team = team
    params = quill.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=3)
    return staggered(core, prompts, params, ARRIVALS)


@pytest.mark.parametrize("name", DENSE)
def test_fixture_models_give_the_python_layers_bits(name):
    llm = quill.LLM(str(fixture_path(name)), skip_tokenizer_init=True)
    fast = run(llm, True)
    assert fast == run(llm, False)
    assert len(fast) == len(PROMPTS) and all(len(t) == 10 for t, _ in fast.values())


# Two threads for every arithmetic (the team splits each op's work); one thread once (a team of one).
@pytest.mark.parametrize("activation,threads", [("none", 2), ("int8", 2), ("int8-group", 2), ("int8-group", 1)])
def test_default_model_gives_the_python_layers_bits(activation, threads):
    llm = quill.LLM(default_model.default_model_path(), activation_quant=activation, threads=threads)
    python = run(llm, False, 24)
    assert run(llm, True, 24) == python
    assert run(llm, True, 24, team=False) == python  # each op splitting its own work


@pytest.mark.skipif(not PLATFORM.has("avx512f"), reason="the AVX2 variant is this CPU's own: tested above")
@pytest.mark.parametrize("activation", ["none", "int8-group"])
def test_avx2_variant_gives_the_python_layers_bits(activation):
    """The step on the AVX2 kernels where the CPU has AVX-512 (what an AVX2-only CPU runs)."""
    llm = quill.LLM(default_model.default_model_path(), activation_quant=activation, threads=2,
                    platform=PLATFORM.limited_to("avx2"))
    assert llm.engine.cache.isa == "avx2"
    python = run(llm, False, 24)
    assert run(llm, True, 24) == python


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("activation", ["none", "int8", "int8-group"])
def test_moe_fixture_models_give_the_python_layers_bits(name, activation):
    """Router, top-k and the routed experts in the step (the ExpertGroup the Python path calls), batched
    sequences arriving at different steps, teamed and op by op."""
    llm = quill.LLM(str(fixture_path(name)), skip_tokenizer_init=True, activation_quant=activation)
    python = run(llm, False)
    assert run(llm, True) == python
    assert run(llm, True, team=False) == python
    assert len(python) == len(PROMPTS) and all(len(t) == 10 for t, _ in python.values())


def test_many_sequences_at_once():
    """16 sequences decoding together (the team splits tokens, row blocks and attention pairs)."""
    llm = quill.LLM(str(fixture_path("ct-w4a16-sym-channel-qwen3")), skip_tokenizer_init=True)
    prompts = [[(7 * i + j) % 300 + 5 for j in range(3 + i)] for i in range(16)]
    outs = []
    for native_step in (True, False):
        core = EngineCore(llm.model, llm.eos_token_ids, llm.context_length,
                          EngineConfig(max_num_seqs=16, native_step=native_step), isa=llm.engine.cache.isa)
        params = quill.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
        for i, p in enumerate(prompts):
            core.add_request(str(i), p, params)
        got: dict[str, list] = {}
        while core.has_unfinished_requests():
            for o in core.step():
                got.setdefault(o.request_id, []).append((o.new_token_ids, sorted(o.logprobs[0].items())))
        outs.append(got)
    assert outs[0] == outs[1] and len(outs[0]) == 16


def test_a_k_quant_mix_whose_parts_cannot_share_a_kernel(tmp_path):
    """llama.cpp's Q4_K_M of the default model holds q/k/v and gate/up at different types in some layers
    (its 576-wide rows fall back to Q5_0 / Q5_1 / Q8_0): the step calls those parts one by one."""
    path = quantize(default_model.default_model_path(), tmp_path / "smol-q4_k_m.gguf", "Q4_K_M")
    llm = quill.LLM(str(path))
    layers = llm.model.model.layers
    assert any(layer.self_attn.qkv.impl is None or layer.mlp.gate_up.impl is None for layer in layers)
    assert any(layer.self_attn.qkv.impl is not None for layer in layers)
    assert run(llm, True, 16) == run(llm, False, 16)


def test_models_it_cannot_run_say_why():
    name = str(fixture_path("ct-w4a16-sym-g128-llama"))
    cases = {
        "layer 0: q_proj+k_proj+v_proj runs kernel reference, not a native one": dict(kernel="reference"),
    }
    for reason, kw in cases.items():
        llm = quill.LLM(name, **kw, skip_tokenizer_init=True)
        assert llm.engine.native_step is None and llm.engine.native_step_reason == reason
    moe = quill.LLM(str(fixture_path("ct-w4a16-mixtral")), skip_tokenizer_init=True, moe_backend="reference")
    assert moe.engine.native_step is None and moe.engine.native_step_reason == (
        "layer 0: model.layers.0.block_sparse_moe: the routed experts do not run as one native expert group")
    off = quill.LLM(name, engine_config=EngineConfig(native_step=False), skip_tokenizer_init=True)
    assert off.engine.native_step is None and off.engine.native_step_reason == "disabled"


def test_bfloat16_is_not_offered_and_runs_the_float32_step():
    """dtype="bfloat16" decoded at 0.5-0.9x float32 on CPUs (issue 12): accepted, warned about, run as float32."""
    name = str(fixture_path("ct-w4a16-sym-g128-llama"))
    with pytest.warns(DtypeNotOfferedWarning, match="dtype 'bfloat16' is not offered: .*running float32"):
        llm = quill.LLM(name, dtype="bfloat16", skip_tokenizer_init=True)
    assert llm.options.dtype == "float32" and llm.engine.native_step is not None
    params = quill.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    f32 = quill.LLM(name, skip_tokenizer_init=True)
    assert llm.generate([[5, 9, 14]], params)[0].token_ids == f32.generate([[5, 9, 14]], params)[0].token_ids


def test_bad_inputs_are_named_errors():
    llm = quill.LLM(str(fixture_path("ct-w4a16-sym-g128-llama")), skip_tokenizer_init=True)
    step = llm.engine.native_step.handle
    args = llm.model.args
    e, d, t = args.hidden_size, args.head_dim, 2
    pool_rows = llm.engine.cache.keys[0].shape[0]
    h = torch.zeros(t, e)
    cos = sin = [torch.zeros(1, t, d)]  # one rotary table
    ctx, lens = torch.zeros(t, 1, dtype=torch.int64), torch.ones(t, dtype=torch.int64)
    good_slots = torch.zeros(t, dtype=torch.int64)
    with pytest.raises(KernelError, match="'h' should be contiguous float32"):
        step.forward(torch.zeros(t, e + 1), cos, sin, good_slots, ctx, lens)
    with pytest.raises(KernelError, match="'cos' should be"):
        step.forward(h, [torch.zeros(t, d)], sin, good_slots, ctx, lens)
    with pytest.raises(KernelError, match="the layers turn by 1 rotary tables; found 0 cos and 0 sin"):
        step.forward(h, [], [], good_slots, ctx, lens)
    with pytest.raises(KernelError, match=f"token 1 writes pool row {pool_rows}; the pool has {pool_rows}"):
        step.forward(h, cos, sin, torch.tensor([0, pool_rows]), ctx, lens)
    with pytest.raises(KernelError, match="sequence 0 has length 2"):
        step.forward(h, cos, sin, good_slots, ctx, torch.tensor([2, 1]))
    layer = llm.model.model.layers[0]
    with pytest.raises(KernelError, match="'input_layernorm' should be contiguous float32"):
        step.add_layer(torch.zeros(e + 1), 1e-6, layer.post_attention_layernorm.weight, 1e-6, [], [], None, None,
                       [], [], None, None, None, None, 0.0, llm.engine.cache.keys[0], llm.engine.cache.values[0])
    with pytest.raises(KernelError, match="q/k/v: expected 1 merged or 3 separate linears"):
        step.add_layer(layer.input_layernorm.weight, 1e-6, layer.post_attention_layernorm.weight, 1e-6,
                       [layer.self_attn.qkv.impl.state.handle] * 2, [None, None],
                       layer.self_attn.o_proj.impl.state.handle, None, [], [],
                       layer.mlp.down_proj.impl.state.handle, None, None, None, 0.0,
                       llm.engine.cache.keys[0], llm.engine.cache.values[0])
    with pytest.raises(KernelError, match="activation 'relu': expected silu or gelu_pytorch_tanh"):
        step.add_layer(layer.input_layernorm.weight, 1e-6, layer.post_attention_layernorm.weight, 1e-6,
                       [layer.self_attn.qkv.impl.state.handle], [None], layer.self_attn.o_proj.impl.state.handle,
                       None, [], [], layer.mlp.down_proj.impl.state.handle, None, None, None, 0.0,
                       llm.engine.cache.keys[0], llm.engine.cache.values[0], activation="relu")
    with pytest.raises(KernelError, match=f"rotary_dim 3: expected 0 \\(all {d} channels\\) or an even count"):
        step.add_layer(layer.input_layernorm.weight, 1e-6, layer.post_attention_layernorm.weight, 1e-6,
                       [layer.self_attn.qkv.impl.state.handle], [None], layer.self_attn.o_proj.impl.state.handle,
                       None, [], [], layer.mlp.down_proj.impl.state.handle, None, None, None, 0.0,
                       llm.engine.cache.keys[0], llm.engine.cache.values[0], rotary_dim=3)
    assert step.num_layers == args.num_hidden_layers  # the failed additions added nothing


def test_a_model_stepped_on_another_thread_than_it_was_loaded_on():
    """libgomp throttles its spinning once two threads have started parallel work; the step's own
    barrier keeps working (and the bits are the same)."""
    import concurrent.futures
    llm = quill.LLM(default_model.default_model_path())
    here = run(llm, True, 12)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as ex:
        there = ex.submit(run, llm, True, 12).result(timeout=300)
    assert there == here == run(llm, False, 12)
