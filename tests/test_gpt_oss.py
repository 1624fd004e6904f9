"""gpt-oss (quill/models/gpt_oss.py): tiny random transformers models against transformers' eager float32
forward: log-probabilities at every position of a prompt several windows long (whole and chunked prefill),
32 greedy tokens, batched = alone, preempted = uninterrupted; the attention sinks matter (zeroed, the
log-probabilities move far beyond the tolerance, so an attention path ignoring them fails); an HF MXFP4
checkpoint (stacked ``*_blocks`` / ``*_scales`` experts) against transformers on its dequantized weights; a
prepacked cache hit scores as the checkpoint; the harmony chat template renders.  GGUF files:
tests/test_gpt_oss_gguf.py; the sinks in the native kernels: tests/test_attention_sinks.py; gpt-oss in the
one-call native decode step: tests/test_gpt_oss_step.py."""

from __future__ import annotations

import json

import pytest
import torch

import quill
from quill.engine.core import EngineCore
from tests.engine_util import engine_core, greedy, hf_logprobs, scored
from tests.gpt_oss_util import CONFIG, ROPE, WINDOW, hf_gpt_oss, randomized  # noqa: F401
from tests.model_util import save_hf_dir

PROMPT = [int(t) for t in torch.randint(4, 320, (100,), generator=torch.Generator().manual_seed(11))]


def core(llm, **cfg) -> EngineCore:
    return engine_core(llm, **{"block_size": 8, **cfg})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_gpt_oss(seed=2)  # a seed whose greedy continuations vary (5-6 distinct tokens of 32), not one repeated
    d = save_hf_dir(hf, tmp_path_factory.mktemp("gpt_oss"), tokenizer=False)
    return hf, quill.LLM(str(d), skip_tokenizer_init=True, kv_cache_dtype="float32")


def test_the_model_describes_gpt_oss(pair):
    _, llm = pair
    specs = llm.model.decoder_layer_specs()
    assert [s.attention.window for s in specs] == [WINDOW, None, WINDOW, None]
    assert all(s.attention.sinks is not None and s.attention.qkv_bias and s.attention.o_bias for s in specs)
    assert specs[0].ffn.activation == "swiglu_clamped(1.702,7.0)" and specs[0].ffn.router_bias
    assert llm.model.rotary.scale == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)  # YaRN's
    assert llm.context_length == 256


@pytest.mark.parametrize("chunk", [256, 24])
def test_logprobs_match_transformers_at_every_position(pair, chunk):
    hf, llm = pair
    got, ref = scored(llm, PROMPT, chunk, block_size=8), hf_logprobs(hf, PROMPT)
    assert got.shape == ref.shape and (got - ref).abs().max() < 1e-3


def test_the_sinks_matter(pair):
    """Zeroing every layer's sinks (what an attention path that ignored them would compute, less the exp(0)
    it would still add) moves the log-probabilities far past the tolerance the other tests hold."""
    hf, llm = pair
    layers = [layer.self_attn.sinks for layer in llm.model.model.layers]
    saved = [s.weight for s in layers]
    try:
        for s in layers:
            s.weight = torch.full_like(s.weight, -1e30)  # exp(-1e30) = 0: no sink at all
        without = scored(llm, PROMPT[:60], block_size=8)
    finally:
        for s, w in zip(layers, saved):
            s.weight = w
    assert (without - hf_logprobs(hf, PROMPT[:60])).abs().max() > 0.05


def test_greedy_batched_and_preempted_match_transformers(pair):
    hf, llm = pair
    prompts = {str(i): PROMPT[i * 9:] for i in range(2)}  # 33 blocks of 8 at the end: 32 preempt one
    want = {}
    with torch.no_grad():
        for rid, p in prompts.items():
            out = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, min_new_tokens=32)
            want[rid] = out[0, len(p):].tolist()
    assert greedy(core(llm), {"0": prompts["0"]}) == {"0": want["0"]}
    assert greedy(core(llm), prompts) == want
    args = llm.model.args
    per_block = 2 * args.num_hidden_layers * 8 * args.num_key_value_heads * args.head_dim * 4
    tight = core(llm, kv_cache_memory=32 * per_block, enable_prefix_caching=False)
    assert greedy(tight, prompts) == want and tight.stats().num_preemptions > 0


def mxfp4_checkpoint(d):
    """(transformers model, directory ``d`` of) an HF MXFP4 checkpoint as gpt-oss ships (experts as stacked
    ``*_blocks`` / ``*_scales`` with float biases, everything else float): transformers cannot write one on
    CPU, so the pairs are drawn here (every FP4 code, exponents near 1) and the transformers model holds their
    dequantization (``convert_moe_packed_tensors``, the tool's own)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = hf_gpt_oss(seed=3, hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=4)
    d = save_hf_dir(hf, d, tokenizer=False)
    state = load_file(str(d / "model.safetensors"))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            ex = layer.mlp.experts
            for proj in ("gate_up_proj", "down_proj"):
                E, inp, out = getattr(ex, proj).shape
                blocks = torch.randint(0, 256, (E, out, inp // 32, 16), dtype=torch.uint8, generator=g)
                scales = torch.randint(118, 124, (E, out, inp // 32), dtype=torch.uint8, generator=g)
                getattr(ex, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                p = f"model.layers.{i}.mlp.experts.{proj}"
                del state[p]
                state[f"{p}_blocks"], state[f"{p}_scales"] = blocks, scales
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (d / "config.json").write_text(json.dumps(cfg))
    return hf, d


def test_mxfp4_checkpoint_matches_transformers_on_its_weights(tmp_path):
    """An HF MXFP4 checkpoint (:func:`mxfp4_checkpoint`) against transformers on its dequantized weights."""
    hf, d = mxfp4_checkpoint(tmp_path / "mx")
    llm = quill.LLM(str(d), skip_tokenizer_init=True, kv_cache_dtype="float32")
    infos = [i for i in llm.loaded.layers if i.kind == "expert"]
    assert infos and all(i.bits == 4 and i.group_size == 32 for i in infos)
    prompt = PROMPT[:70]
    assert (scored(llm, prompt, 24, block_size=8) - hf_logprobs(hf, prompt)).abs().max() < 1e-3


def test_harmony_chat_template_renders(tmp_path):
    """gpt-oss's harmony template (tests/data/chat_templates, llama.cpp's copy of the one the model ships): the
    system prompt becomes the developer instructions, an assistant turn its final channel, the generation prompt
    an open assistant turn; as transformers renders it (text; channels and tools are not parsed yet)."""
    import re
    from pathlib import Path

    import transformers

    from quill.tokenizer import Tokenizer, hf_tokenizer_spec
    from tests.model_util import byte_tokenizer
    tok = byte_tokenizer()
    tok.add_special_tokens(["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    template = (Path(__file__).parent / "data" / "chat_templates" / "openai-gpt-oss-120b.jinja").read_text()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]
    got = Tokenizer(hf_tokenizer_spec(tmp_path, {})).apply_chat_template(chat, add_generation_prompt=True)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)
    assert got == ref
    assert re.fullmatch(
        r"<\|start\|>system<\|message\|>You are ChatGPT, a large language model trained by OpenAI\.\n"
        r"Knowledge cutoff: 2024-06\nCurrent date: \d{4}-\d\d-\d\d\n\nReasoning: medium\n\n# Valid channels: "
        r"analysis, commentary, final\. Channel must be included for every message\.<\|end\|>"
        r"<\|start\|>developer<\|message\|># Instructions\n\nBe brief\.\n\n<\|end\|>"
        r"<\|start\|>user<\|message\|>hello<\|end\|><\|start\|>assistant<\|channel\|>final<\|message\|>hi<\|end\|>"
        r"<\|start\|>user<\|message\|>again<\|end\|><\|start\|>assistant", got)


def test_prepacked_cache_hit_scores_as_the_checkpoint(pair, tmp_path):
    """The stacked-expert slots save nothing of their own (the experts they filled are the MoE block's), so a
    prepacked cache hit rebuilds the same model."""
    _, llm = pair
    kw = dict(skip_tokenizer_init=True, kv_cache_dtype="float32", cache=True, cache_dir=tmp_path)
    miss = quill.LLM(str(llm.loaded.path), **kw)
    miss.cache.wait()  # the file of a miss is written on a thread
    hit = quill.LLM(str(llm.loaded.path), **kw)
    assert hit.cache_hit and not miss.cache_hit
    assert torch.equal(scored(hit, PROMPT[:40], block_size=8), scored(llm, PROMPT[:40], block_size=8))


def test_bad_configs_and_checkpoints_are_refused(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    from quill.errors import CheckpointError, ModelError
    from quill.models.gpt_oss import ModelArgs
    base = {"model_type": "gpt_oss", **CONFIG}
    with pytest.raises(ModelError, match="config field 'layer_types': expected 4 entries"):
        ModelArgs.from_dict({**base, "layer_types": ["sliding_attention"] * 3})
    with pytest.raises(ModelError, match="config field 'swiglu_limit': expected a positive number"):
        ModelArgs.from_dict({**base, "swiglu_limit": -1.0})
    with pytest.raises(ModelError, match="num_experts_per_tok 5 exceeds the 4 experts"):
        ModelArgs.from_dict({**base, "num_experts_per_tok": 5})
    _, llm = pair
    d = tmp_path / "bad"
    d.mkdir()
    (d / "config.json").write_text((llm.loaded.path / "config.json").read_text())
    state = load_file(str(llm.loaded.path / "model.safetensors"))
    p = "model.layers.1.mlp.experts.gate_up_proj"
    state[p] = state[p][:, :, :-2].contiguous()  # one expert row short
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.1.mlp.experts.gate_up_proj' has shape "
                                              r"\[4, 72, 78\], the model expects \[4, 72, 80\]"):
        quill.LLM(str(d), skip_tokenizer_init=True)
