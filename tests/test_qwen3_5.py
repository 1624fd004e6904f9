"""Qwen3.5 dense and MoE (hybrid Gated DeltaNet + gated attention) against transformers, through the engine.

Tiny random models made with transformers here: head dims that are not powers of two (24 / 20), more value
heads than key heads, 4 layers (3 linear-attention + 1 full-attention), A_log, dt_bias and every norm far
from their init.  The reference is transformers' float32 forward; quill runs a float32 KV cache.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import quill
from quill.engine.core import EngineConfig, EngineCore
from quill.engine.state_cache import StatePool
from quill.errors import CheckpointError, GenerationError
from quill.layers.deltanet import StateSpec
from quill.models.base import ForwardContext
from tests.engine_util import staggered
from tests.model_util import save_hf_dir
from tests.qwen3_5_util import VOCAB, hf_qwen3_5

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPT_LEN = 150  # longer than two chunks of 64


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_5_moe_text"])
def pair(request, tmp_path_factory):
    """(transformers model, quill LLM, checkpoint dir) of one architecture."""
    hf = hf_qwen3_5(moe="moe" in request.param)
    d = save_hf_dir(hf, tmp_path_factory.mktemp(request.param) / "ckpt", tokenizer=False)
    assert json.loads((d / "config.json").read_text())["model_type"] == request.param
    llm = quill.LLM(str(d), kernel="reference", skip_tokenizer_init=True, kv_cache_dtype="float32")
    return hf, llm, d


def engine(llm, **cfg) -> EngineCore:
    return EngineCore(llm.model, llm.eos_token_ids, llm.context_length,
                      EngineConfig(**{"kv_cache_dtype": "float32", **cfg}))


def run(core: EngineCore, prompts: dict[str, list[int]], max_tokens: int, **params) -> dict:
    """request id -> (generated tokens, prompt-token log-probs or None)."""
    for rid, p in prompts.items():
        core.add_request(rid, p, quill.SamplingParams(max_tokens=max_tokens, **GREEDY, **params))
    out: dict = {rid: ([], None) for rid in prompts}
    for _ in range(10_000):
        if not core.has_unfinished_requests():
            break
        for o in core.step():
            out[o.request_id][0].extend(o.new_token_ids)
            if o.prompt_logprobs is not None:
                ids = prompts[o.request_id]
                lps = [lp[ids[i]].logprob for i, lp in enumerate(o.prompt_logprobs) if lp is not None]
                out[o.request_id] = (out[o.request_id][0], torch.tensor(lps))
    return out


def test_logprobs_match_transformers_at_every_position(pair):
    hf, llm, _ = pair
    ids = prompt(PROMPT_LEN, 1)
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits.float(), -1)[0]
    with torch.inference_mode():  # quill's cache-less forward: the chunked delta rule over the whole prompt
        got = torch.log_softmax(llm.model(torch.tensor([ids]), ForwardContext.causal(1, PROMPT_LEN)), -1)[0]
    assert (got - want).abs().max() < 1e-3
    # through the engine: prefill split across steps (64 tokens a step), the state carried between them
    core = engine(llm, max_num_batched_tokens=64)
    (_, lps), = run(core, {"a": ids}, 1, prompt_logprobs=0).values()
    ref = want[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert (lps - ref).abs().max() < 1e-3


def test_greedy_tokens_match_transformers(pair):
    hf, llm, _ = pair
    ids = prompt(20, 2)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, 20:]
    got = run(engine(llm), {"a": ids}, 32)["a"][0]
    assert got == want.tolist()


def test_batched_preempted_and_chunked_equal_alone(pair):
    """Hybrid sequences of different lengths in one step (prefill chunks beside decodes) give the tokens each
    gets alone; so do they preempted and recomputed while prefilled 16 tokens a step."""
    _, llm, _ = pair
    if llm.model.args.model_type != "qwen3_5_text":
        pytest.skip("the engine's state handling does not depend on the feed-forward block: the dense model's run")
    prompts = {"long": prompt(PROMPT_LEN, 3), "mid": prompt(47, 5), "short": prompt(5, 4)}
    alone = {rid: run(engine(llm), {rid: p}, 6)[rid][0] for rid, p in prompts.items()}
    assert {rid: toks for rid, (toks, _) in run(engine(llm), prompts, 6).items()} == alone
    probe = engine(llm, max_num_seqs=3)
    state = probe.stats().state_bytes  # 3 sequences' state; then room for 13 blocks of 16 tokens
    per_block = probe.cache.nbytes() // probe.blocks.num_blocks
    tight = engine(llm, max_num_seqs=3, kv_cache_memory=state + 13 * per_block, max_num_batched_tokens=16)
    assert tight.blocks.num_blocks == 13  # long + mid fill it; mid's decode then preempts mid itself
    got = run(tight, prompts, 6)
    assert tight.stats().num_preemptions > 0
    assert {rid: toks for rid, (toks, _) in got.items()} == alone
    stats = tight.stats()
    assert stats.state_slots_used == 0 and stats.kv_blocks_used == 0  # all freed on finish


def test_engine_describes_the_hybrid_model(pair):
    _, llm, _ = pair
    core = engine(llm)
    stats = core.stats()
    assert not stats.prefix_caching and not core.blocks.prefix_caching  # recurrent state: no prefix reuse
    assert stats.state_slots_total == core.config.max_num_seqs and stats.state_bytes > 0
    assert [k.shape[0] > 0 for k in core.cache.keys] == [False, False, False, True]  # KV only for attention
    native = llm.engine  # built with the load's native ISA: the step is refused for a reason, not for lack of one
    assert native.native_step is None  # (the reference kernels: the hybrid model on native ones is tested below)
    assert native.native_step_reason.startswith("layer 0: ") and "native" in native.native_step_reason
    assert "recurrent" not in native.native_step_reason


def test_bad_checkpoints_are_named_errors(pair, tmp_path):
    from safetensors.torch import load_file, save_file
    _, llm, d = pair
    if llm.model.args.model_type != "qwen3_5_text":
        pytest.skip("one architecture is enough")
    state = load_file(d / "model.safetensors")
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    missing = {k: v for k, v in state.items() if k != "model.layers.1.linear_attn.conv1d.weight"}
    save_file(missing, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.linear_attn\.conv1d"):
        quill.LLM(str(bad), kernel="reference", skip_tokenizer_init=True)
    # a config whose conv kernel (its state holds kernel - 1 inputs) disagrees with the tensors
    save_file(state, bad / "model.safetensors")
    cfg = json.loads((d / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "linear_conv_kernel_dim": 3}))
    with pytest.raises(CheckpointError, match=r"conv1d\.weight' has shape \[176, 1, 4\], the model expects "
                                              r"\[176, 1, 3\]"):
        quill.LLM(str(bad), kernel="reference", skip_tokenizer_init=True)


def test_multimodal_checkpoint_runs_its_text_model(pair, tmp_path, caplog):
    """A qwen3_5 checkpoint (text model under model.language_model, a vision tower beside it): the text model
    loads and runs, the vision tensors are skipped with one log line."""
    from safetensors.torch import load_file, save_file
    _, llm, d = pair
    if llm.model.args.model_type != "qwen3_5_text":
        pytest.skip("one architecture is enough")
    text = json.loads((d / "config.json").read_text())
    state = {k.replace("model.", "model.language_model.", 1): v for k, v in load_file(d / "model.safetensors").items()}
    state.update({"model.visual.blocks.0.attn.qkv.weight": torch.zeros(8, 4), "model.visual.merger.norm.weight":
                  torch.ones(4)})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "architectures":
                                                      ["Qwen3_5ForConditionalGeneration"], "text_config": text,
                                                      "vision_config": {"depth": 1}}))
    save_file(state, tmp_path / "model.safetensors")
    with caplog.at_level("INFO", logger="quill.engine"):
        mm = quill.LLM(str(tmp_path), kernel="reference", skip_tokenizer_init=True, kv_cache_dtype="float32")
    assert [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()] == [
        f"{tmp_path}: 2 tensors skipped (^(model\\.visual|visual|mtp)\\.: parts the qwen3_5 text model does not "
        "run, e.g. a vision tower)"]
    ids = torch.tensor([prompt(30, 6)])
    with torch.inference_mode():
        assert torch.equal(mm.model(ids, ForwardContext.causal(1, 30)), llm.model(ids, ForwardContext.causal(1, 30)))


def test_state_of_the_wrong_size_is_refused():
    pool = StatePool([None, StateSpec(((6, 3), (2, 4, 5)))], num_slots=2)
    view = pool.views([None, None], [pool.take("r")], [(0, 1)])[1]
    with pytest.raises(GenerationError, match=r"recurrent state of shape \[2, 4, 4\] does not match the "
                                              r"described \[2, 4, 5\]"):
        view.write([0], [torch.zeros(1, 6, 3), torch.zeros(1, 2, 4, 4)])


def step_run(llm, native_step: bool, isa: str, team: bool = True) -> dict:
    """request -> (greedy tokens, top-3 log-probabilities per token): sequences of different lengths arriving at
    different steps, through a fresh engine on decode attention variant ``isa``."""
    c = EngineCore(llm.model, llm.eos_token_ids, llm.context_length,
                   EngineConfig(kv_cache_dtype="float32", native_step=native_step, max_num_seqs=4,
                                max_num_batched_tokens=32), isa=isa)
    assert (c.native_step is not None) == native_step, c.native_step_reason
    if native_step:
        c.native_step.team = team
    params = quill.SamplingParams(max_tokens=16, logprobs=3, **GREEDY)
    return staggered(c, [prompt(5 + 7 * i, 10 + i) for i in range(3)], params, {0: [0, 1], 3: [2]})


@pytest.fixture(scope="module", params=["dense", "moe", "dense-hybrid", "moe-hybrid"])
def attention_only(request, tmp_path_factory):
    """(transformers model, quill LLM on the native kernels) of a Qwen3.5 whose every layer is gated attention
    (partial rotary, q/k norms; MoE: routed experts and a sigmoid-gated shared expert), or (hybrid) the usual
    3 Gated DeltaNet layers and 1 gated attention layer."""
    hybrid = {} if "hybrid" in request.param else {"layer_types": ["full_attention"] * 4}
    hf = hf_qwen3_5(moe=request.param.startswith("moe"), **hybrid)
    with torch.no_grad():  # bfloat16-valued: what the native dense kernels hold
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    d = save_hf_dir(hf, tmp_path_factory.mktemp(request.param) / "ckpt", tokenizer=False)
    return hf, quill.LLM(str(d), skip_tokenizer_init=True, kv_cache_dtype="float32")


@pytest.mark.parametrize("isa", ["native", "scalar"])
def test_the_native_step_runs_qwen3_5_with_the_python_layers_bits(attention_only, isa):
    hf, llm = attention_only
    assert llm.engine.native_step is not None, llm.engine.native_step_reason
    spec = llm.model.decoder_layer_specs()[3]  # gated attention in both layouts
    assert spec.attention.output_gate and spec.attention.rotary_dim < spec.attention.head_dim
    isa = llm.engine.cache.isa if isa == "native" else isa
    python = step_run(llm, False, isa)
    assert step_run(llm, True, isa) == python
    assert step_run(llm, True, isa, team=False) == python
    assert len(python) == 3 and all(len(t) == 16 for t, _ in python.values())


def test_the_native_step_gives_transformers_greedy_tokens(attention_only):
    hf, llm = attention_only
    ids = prompt(20, 2)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, 20:]
    core = EngineCore(llm.model, llm.eos_token_ids, llm.context_length,
                      EngineConfig(kv_cache_dtype="float32"), isa=llm.engine.cache.isa)
    assert core.native_step is not None, core.native_step_reason
    assert run(core, {"a": ids}, 24)["a"][0] == want.tolist()


def test_the_step_checks_the_state_rows(attention_only):
    from quill.errors import KernelError
    _, llm = attention_only  # (the hybrid models: each token's state row, no two alike, in the pools)
    step = llm.engine.native_step
    if not step.states:
        pytest.skip("no recurrent layers")
    args, t = llm.model.args, 2
    h, cos = torch.zeros(t, args.hidden_size), [torch.zeros(1, t, args.rotary_dim)]
    slots, ctx = torch.zeros(t, dtype=torch.int64), torch.zeros(t, 1, dtype=torch.int64)
    lens = torch.ones(t, dtype=torch.int64)
    with pytest.raises(KernelError, match="the recurrent layers need 'state_rows'"):
        step.handle.forward(h, cos, cos, slots, ctx, lens)
    with pytest.raises(KernelError, match="two sequences name state row 1"):
        step.handle.forward(h, cos, cos, slots, ctx, lens, state_rows=torch.tensor([1, 1]))
    with pytest.raises(KernelError, match="sequence 1 names state row 99"):
        step.handle.forward(h, cos, cos, slots, ctx, lens, state_rows=torch.tensor([0, 99]))


def test_a_refused_step_leaves_the_states_as_they_were(attention_only):
    """The team path checks everything before it writes a state row, so its wrapper keeps no copies of them."""
    from types import SimpleNamespace

    from quill.errors import KernelError
    _, llm = attention_only
    core = EngineCore(llm.model, llm.eos_token_ids, llm.context_length, EngineConfig(kv_cache_dtype="float32"),
                      isa=llm.engine.cache.isa)
    step = core.native_step
    if not step.states:
        pytest.skip("no recurrent layers")
    args, t = llm.model.args, 2
    assert step.handle.all_or_nothing(t)
    for pool in step.states:
        pool.normal_()
    before = [pool.clone() for pool in step.states]
    h, cos = torch.ones(1, t, args.hidden_size), torch.zeros(1, t, args.rotary_dim)
    layout = SimpleNamespace(slots=torch.zeros(t, dtype=torch.int64), decode_slots=torch.zeros(t, 1, dtype=torch.int64),
                             decode_lens=torch.tensor([1, 0]))  # sequence 1: no context (refused)
    with pytest.raises(KernelError, match="sequence 1 has length 0"):
        step(layout, h, (cos, cos), state_rows=torch.tensor([0, 1]))
    assert all(torch.equal(a, b) for a, b in zip(step.states, before))
    layout.decode_lens = torch.tensor([1, 1])
    step(layout, h, (cos, cos), state_rows=torch.tensor([0, 1]))  # and a step that runs writes them
    assert not all(torch.equal(a, b) for a, b in zip(step.states, before))
