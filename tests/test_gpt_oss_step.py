"""gpt-oss in the one-call native decode step (quill.layers.native_step; csrc/step.cpp, step_moe.h): attention
sinks, the alternating sliding window, q/k/v/o biases and the YaRN table, the biased router's top-k softmax and
the biased experts' clamped SwiGLU (one native ExpertGroup, the Python path's own call) give the Python layers'
bits -- greedy tokens and top-3 log-probabilities of batched sequences past the window arriving at different
steps, teamed on 2 threads and op by op, on this CPU's kernels, the AVX2 ones and the scalar twins -- with dense
(bfloat16-valued), HF MXFP4 and llama.cpp MXFP4_MOE / Q8_0 experts; `quill inspect` says the step runs; the
expert group's clamped SwiGLU and biases are the per-expert Python path's to float32 rounding."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import quill
from quill import native
from quill.cli.inspect import report
from quill.engine.core import EngineConfig, EngineCore
from quill.errors import KernelError
from quill.moe import DenseWeight, build_fused_moe
from quill.moe.config import swiglu_clamped_name
from quill.platform import detect
from tests.engine_util import staggered
from tests.model_util import save_hf_dir
from tests.moe_util import FORMATS, make_experts, selectors
from tests.test_gpt_oss import PROMPT, hf_gpt_oss, mxfp4_checkpoint
from tests.test_gpt_oss_gguf import converted  # noqa: F401  (the llama.cpp files, a module fixture)

pytestmark = pytest.mark.skipif(native.load().module is None, reason="native kernels not built")
CLAMPED = swiglu_clamped_name(1.702, 7.0)


def step_run(llm, native_step: bool, isa: str, team: bool = True, prompts=None) -> dict:
    """request -> (greedy tokens, top-3 log-probabilities per token): three sequences of 5, 11 and 17 tokens, 24
    tokens each (past the sliding layers' window of 16), arriving at steps 0, 0 and 3, through a fresh engine on
    decode attention variant ``isa``."""
    c = EngineCore(llm.model, llm.eos_token_ids, llm.context_length,
                   EngineConfig(kv_cache_dtype="float32", block_size=8, native_step=native_step, max_num_seqs=4,
                                max_num_batched_tokens=32), isa=isa)
    assert (c.native_step is not None) == native_step, c.native_step_reason
    if native_step:
        c.native_step.team = team
    prompts = prompts or [PROMPT[i * 7:i * 7 + 5 + 6 * i] for i in range(3)]
    params = quill.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    return staggered(c, prompts, params, {0: [0, 1], 3: [2]})


def same_bits(llm, isa: str) -> None:
    """Step on (teamed, then op by op) = step off, bit for bit."""
    python = step_run(llm, False, isa)
    assert step_run(llm, True, isa) == python
    assert step_run(llm, True, isa, team=False) == python
    assert len(python) == 3 and all(len(t) == 24 for t, _ in python.values())
    assert len({tuple(t) for t, _ in python.values()}) > 1  # (the sequences differ)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    hf = hf_gpt_oss(seed=2)  # bfloat16-valued weights: the native dense kernels hold them
    d = save_hf_dir(hf, tmp_path_factory.mktemp("gptoss_step") / "ckpt", tokenizer=False)
    return quill.LLM(str(d), skip_tokenizer_init=True, kv_cache_dtype="float32", threads=2)


def test_the_native_step_runs_gpt_oss(dense):
    assert dense.engine.native_step is not None, dense.engine.native_step_reason
    assert dense.engine.native_step.handle.num_layers == 4
    text = report(dense)
    assert "decode step: native: every decoder layer in one call" in text
    assert "moe experts: 4 of 4 MoE layers run their routed experts in one native call" in text
    for refused in ("sinks", "clamped", "router bias"):
        assert refused not in text


@pytest.mark.parametrize("isa", ["native", "avx2", "scalar"])
def test_the_native_step_gives_the_python_layers_bits(dense, isa):
    """Dense experts; decode attention with sinks on this CPU's variant, the AVX2 one and the scalar twin."""
    if isa == "avx2" and (dense.engine.cache.isa == "avx2" or not detect().has("avx2")):
        pytest.skip("the AVX2 variant is this CPU's own (tested as native), or the CPU has none")
    same_bits(dense, dense.engine.cache.isa if isa == "native" else isa)


def test_mxfp4_experts_give_the_python_layers_bits(tmp_path):
    """An HF MXFP4 checkpoint: the experts on the native MXFP4 kernel, biases beside them, in the step."""
    _, d = mxfp4_checkpoint(tmp_path / "mx")
    llm = quill.LLM(str(d), skip_tokenizer_init=True, kv_cache_dtype="float32", threads=2)
    assert {i.bits for i in llm.loaded.layers if i.kind == "expert"} == {4}
    assert llm.engine.native_step is not None, llm.engine.native_step_reason
    same_bits(llm, llm.engine.cache.isa)
    same_bits(llm, "scalar")


@pytest.mark.parametrize("qtype", ["MXFP4_MOE", "Q8_0"])
def test_llama_cpp_files_give_the_python_layers_bits(converted, qtype):  # noqa: F811
    """llama.cpp's converter and quantizer: MXFP4 experts beside Q8_0 attention, or Q8_0 throughout, on the
    activations quill chooses for them."""
    _, files = converted
    llm = quill.LLM(str(files[qtype]), skip_tokenizer_init=True, kv_cache_dtype="float32", threads=2)
    assert llm.engine.native_step is not None, llm.engine.native_step_reason
    vocab = llm.model.args.vocab_size
    prompts = [[(37 * i + 11 * j) % (vocab - 4) + 4 for j in range(5 + 6 * i)] for i in range(3)]
    python = step_run(llm, False, llm.engine.cache.isa, prompts=prompts)
    assert step_run(llm, True, llm.engine.cache.isa, prompts=prompts) == python
    assert step_run(llm, True, llm.engine.cache.isa, team=False, prompts=prompts) == python


# ---- the expert group: biases and the clamped SwiGLU --------------------------------------------

def biased(experts, seed: int):
    """``experts`` with a bias on every projection (gpt-oss's)."""
    g = torch.Generator().manual_seed(seed)

    def with_bias(p):
        b = torch.randn(p.out_features, generator=g) * 0.5
        return dataclasses.replace(p, bias=b) if isinstance(p, DenseWeight) else p.with_(bias=b)
    return [dataclasses.replace(ex, gate=with_bias(ex.gate), up=with_bias(ex.up), down=with_bias(ex.down))
            for ex in experts]


@pytest.mark.parametrize("fmt", ["w4-sym-g32", "bf16"])
def test_the_expert_group_runs_biases_and_the_clamped_swiglu(fmt):
    """Inputs large enough that most gates and ups pass the clamp: one call (teamed, op by op) gives the
    per-expert Python path's result (torch's spelling of the activation) to float32 rounding."""
    E, H, I = 6, 64, 32
    experts = biased(make_experts(E, H, I, FORMATS[fmt], seed=21), seed=22)
    moe_sel, lin_sel = selectors(platform=detect())
    moe = build_fused_moe("model.layers.0.mlp", experts, 4, moe_sel, lin_sel, None, CLAMPED)
    group = moe.state.group
    assert group is not None and group.num_experts == E
    g = torch.Generator().manual_seed(23)
    for ids in ([[0, 5, 3, 3]], [[2, 4]], [[1, 0, 5, 2], [5, 5, 1, 3], [0, 2, 4, 1]]):
        ids = torch.tensor(ids)
        x = torch.randn(ids.shape[0], H, generator=g) * 20
        w = torch.rand(ids.shape, generator=g) + 0.1
        got = moe(x, ids, w)
        assert torch.equal(got, group.forward(x, ids, w, team=False))
        moe.state.group = None
        want = moe(x, ids, w)
        moe.state.group = group
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        silu = build_fused_moe("model.layers.0.mlp", experts, 4, moe_sel, lin_sel, None, "silu")
        assert (silu(x, ids, w) - got).abs().max() > 1.0  # (the clamp and the +1 matter here)


def test_the_expert_group_names_bad_activations_and_biases():
    ext = native.load().module
    with pytest.raises(KernelError, match="activation 'gelu': expected silu, gelu_tanh or swiglu_clamped"):
        ext.ExpertGroup(64, 32, "gelu")
    with pytest.raises(KernelError, match="swiglu_clamped: alpha 1.702 and limit 0 should be positive"):
        ext.ExpertGroup(64, 32, "swiglu_clamped", 1.702, 0.0)
    moe_sel, lin_sel = selectors(platform=detect())
    moe = build_fused_moe("m", make_experts(2, 64, 32, FORMATS["w4-sym-g32"], seed=1), 1, moe_sel, lin_sel)
    ex = moe.state.experts[0]
    group = ext.ExpertGroup(64, 32, "swiglu_clamped", 1.702, 7.0)
    with pytest.raises(KernelError, match=r"expert 0: gate_up bias is \[3\], expected \[64\]"):
        group.add_expert(ex.gate_up.state.handle, ex.down.state.handle, torch.zeros(3))
    assert group.num_experts == 0
