"""Gemma 4 text (quill/models/gemma4.py): a tiny random transformers ``gemma4_text`` model with odd sizes, per-layer
input embeddings, KV-shared layers (a local and a global one, MLPs doubled), global layers with their own head
size, one KV head whose values are the keys (attention_k_eq_v) and proportional rope, against transformers'
eager float32 forward: log-probabilities at every position of a prompt several windows long (whole and chunked
prefill), 32 greedy tokens, batched = alone, preempted = uninterrupted (the native decode step on: its own
bits are tests/test_gemma4_step.py's); the text half of a multimodal ``gemma4`` checkpoint; Gemma 4's chat
template renders as transformers renders it; bad input is a named error.  GGUF files: tests/test_gemma4_gguf.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import quill
from quill.errors import CheckpointError, ModelError
from quill.models.base import ForwardContext
from tests.engine_util import engine_core, greedy, hf_logprobs, scored
from tests.gemma4_util import TEXT, WINDOW, G, L, hf_gemma4, randomized  # noqa: F401
from tests.model_util import save_hf_dir

PROMPT = [int(t) for t in torch.randint(4, 320, (100,), generator=torch.Generator().manual_seed(11))]
TEMPLATE = Path(__file__).parent / "data" / "chat_templates" / "google-gemma-4-31B-it.jinja"  # from llama.cpp


def core(llm, **cfg):
    return engine_core(llm, **{"block_size": 8, **cfg})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    hf = hf_gemma4(seed=1)
    return hf, save_hf_dir(hf, tmp_path_factory.mktemp("gemma4"), tokenizer=False)


@pytest.fixture(scope="module")
def pair(saved):
    hf, d = saved
    return hf, quill.LLM(str(d), skip_tokenizer_init=True, kv_cache_dtype="float32")


def test_the_model_describes_gemma4(pair):
    _, llm = pair
    m = llm.model
    specs = m.decoder_layer_specs()
    assert [s.attention.window for s in specs] == [WINDOW, None] * 3
    assert [s.rope for s in specs] == ["local", "global"] * 3
    assert [s.attention.head_dim for s in specs] == [16, 24] * 3 and specs[1].attention.kv_heads == 1
    assert [m.args.kv_source(i) for i in range(6)] == [None] * 4 + [2, 3]
    assert m.kv_layer_shapes() == [(2, 16), (1, 24)] * 2 + [None, None]
    assert [s.ffn.intermediate for s in specs] == [100] * 4 + [200] * 2
    cache = llm.engine.cache
    assert [tuple(k.shape[1:]) for k in cache.keys[:4]] == [(2, 16), (1, 24)] * 2
    assert cache.keys[4].numel() == 0 and cache.keys[5].numel() == 0


@pytest.mark.parametrize("chunk", [256, 24])
def test_logprobs_match_transformers_at_every_position(pair, chunk):
    hf, llm = pair
    got = scored(llm, PROMPT, chunk, block_size=8)
    ref = hf_logprobs(hf, PROMPT)
    assert got.shape == ref.shape and (got - ref).abs().max() < 1e-3


def test_a_cacheless_forward_matches_transformers(pair):
    hf, llm = pair
    ids = torch.tensor([PROMPT[:60]])
    with torch.inference_mode():
        got = llm.model(ids, ForwardContext.causal(1, 60))
        ref = hf(ids).logits
    assert (got - ref).abs().max() < 1e-4


def test_greedy_batched_and_preempted_match_transformers(pair):
    hf, llm = pair
    prompts = {str(i): PROMPT[i * 9:] for i in range(3)}
    want = {}
    with torch.no_grad():
        for rid, p in prompts.items():
            out = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, min_new_tokens=32)
            want[rid] = out[0, len(p):].tolist()
    c = core(llm)
    assert greedy(c, {"0": prompts["0"]}) == {"0": want["0"]}
    # again on the same engine: the prompt's blocks come from the prefix cache (the shared layers read them too)
    assert greedy(c, {"again": prompts["0"]}) == {"again": want["0"]} and c.stats().prefix_cache_hit_tokens > 0
    assert greedy(core(llm), prompts) == want
    per_block = 8 * 2 * 4 * sum(h * d for h, d in filter(None, llm.model.kv_layer_shapes()))
    tight = core(llm, kv_cache_memory=32 * per_block, enable_prefix_caching=False)
    assert greedy(tight, prompts) == want and tight.stats().num_preemptions > 0


def test_values_from_their_own_projection(tmp_path):
    """Without attention_k_eq_v: global layers with a v_proj and the local layers' KV head count; no PLE."""
    hf = hf_gemma4(seed=3, attention_k_eq_v=False, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                   use_double_wide_mlp=False)
    d = save_hf_dir(hf, tmp_path / "plain", tokenizer=False)
    llm = quill.LLM(str(d), skip_tokenizer_init=True, kv_cache_dtype="float32")
    assert llm.model.kv_layer_shapes() == [(2, 16), (2, 24)] * 3
    got = scored(llm, PROMPT, 40, block_size=8)
    assert (got - hf_logprobs(hf, PROMPT)).abs().max() < 1e-3


def test_multimodal_checkpoint_loads_its_text_model(tmp_path, caplog):
    import transformers
    text = hf_gemma4(seed=2)
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64)
    cfg = transformers.Gemma4Config(text_config=text.config.to_dict(), vision_config=vision)
    mm = transformers.Gemma4ForConditionalGeneration(cfg).eval()
    mm.model.language_model.load_state_dict(text.model.state_dict())
    mm.lm_head.load_state_dict(text.lm_head.state_dict())
    d = save_hf_dir(mm, tmp_path / "mm", tokenizer=False)
    with caplog.at_level(logging.INFO, logger="quill"):
        llm = quill.LLM(str(d), skip_tokenizer_init=True, kv_cache_dtype="float32")
    assert any("skipped" in r.getMessage() for r in caplog.records)
    assert llm.model.args.model_type == "gemma4"
    ids = torch.tensor([PROMPT[:40]])
    with torch.inference_mode():
        got = llm.model(ids, ForwardContext.causal(1, 40))
        ref = text(ids).logits
    assert (got - ref).abs().max() < 1e-4


def edited(d: Path, out: Path, edit) -> Path:
    """A copy of checkpoint ``d`` whose tensors ``edit`` changed in place."""
    out.mkdir()
    for f in d.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    state = load_file(str(d / "model.safetensors"))
    edit(state)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_missing_tensor_is_a_named_error(saved, tmp_path):
    _, d = saved
    bad = edited(d, tmp_path / "bad", lambda s: s.pop("model.layers.3.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.self_attn\.k_proj"):
        quill.LLM(str(bad), skip_tokenizer_init=True)


def test_kv_shared_layers_own_projections_are_skipped(saved, tmp_path):
    """A checkpoint may hold k/v projections and norms for KV-shared layers (transformers ignores them too)."""
    _, d = saved
    extra = {"model.layers.4.self_attn.k_proj.weight": torch.ones(32, 72),
             "model.layers.5.self_attn.k_norm.weight": torch.ones(24)}
    llm = quill.LLM(str(edited(d, tmp_path / "extra", lambda s: s.update(extra))), skip_tokenizer_init=True)
    assert llm.model.kv_layer_shapes()[4:] == [None, None]


def test_configs_it_cannot_run_are_named_errors(saved, tmp_path):
    _, d = saved
    cfg = json.loads((d / "config.json").read_text())
    for change, field in (({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5,
                            "moe_intermediate_size": 16}, "exceeds the 4 experts"),
                          ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
                          ({"num_kv_shared_layers": 5}, "KV-shared")):
        from quill.models import model_module
        mod = model_module("gemma4_text")
        with pytest.raises(ModelError, match=field):
            mod.ModelArgs.from_dict({**cfg, **change})


def test_gemma4_chat_template_renders(tmp_path):
    import transformers

    from quill.tokenizer import Tokenizer, hf_tokenizer_spec
    from tests.model_util import byte_tokenizer
    tok = byte_tokenizer()
    tok.add_special_tokens(["<|turn>", "<turn|>", "<bos>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE.read_text(), "bos_token": "<bos>", "eos_token": "<turn|>",
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    ours = Tokenizer(hf_tokenizer_spec(tmp_path, {}))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello "},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]
    got = ours.apply_chat_template(chat, add_generation_prompt=True)
    # thinking off (the template's default): an empty thought channel opens the model's turn
    assert got.startswith("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nhello<turn|>\n")
    assert got.endswith("<|turn>model\n<|channel>thought\n<channel|>")
    assert got == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    tools = [{"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "required": ["city"],
                                                              "properties": {"city": {"type": "string"}}}}}]
    got = ours.apply_chat_template(chat[1:], add_generation_prompt=True, tools=tools)
    assert "weather" in got
    assert got == theirs.apply_chat_template(chat[1:], tokenize=False, add_generation_prompt=True, tools=tools)
    got = ours.apply_chat_template(chat, add_generation_prompt=True, template_kwargs={"enable_thinking": True})
    assert "<|think|>" in got and not got.endswith("<channel|>")
    assert got == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=True)


def test_the_moe_variant_matches_transformers(tmp_path):
    """enable_moe_block: routed experts (stacked, gate and up in halves; gelu-tanh) beside each dense MLP, the
    scaled router with per-expert scales, their own norms; logprobs at every position, chunked."""
    hf = hf_gemma4(seed=5, enable_moe_block=True, num_experts=5, top_k_experts=2, moe_intermediate_size=20)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("router.scale", "per_expert_scale")):
                p.copy_(torch.rand_like(p) + 0.5)
    d = save_hf_dir(hf, tmp_path / "moe", tokenizer=False)
    llm = quill.LLM(str(d), skip_tokenizer_init=True, kv_cache_dtype="float32")
    assert all(layer.moe is not None for layer in llm.model.model.layers)
    assert llm.engine.native_step is not None, llm.engine.native_step_reason  # (its bits: test_gemma4_step.py)
    got = scored(llm, PROMPT, 24, block_size=8)
    assert (got - hf_logprobs(hf, PROMPT)).abs().max() < 1e-3
    prompts = {str(i): PROMPT[i * 9:i * 9 + 30] for i in range(2)}
    with torch.no_grad():
        want = {rid: hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                                 min_new_tokens=16)[0, len(p):].tolist() for rid, p in prompts.items()}
    assert greedy(core(llm), prompts, n=16) == want
