"""Gemma 3 text (quill/models/gemma3.py): tiny random transformers models (gemma3_text, and the text half of a
multimodal gemma3 checkpoint) against transformers' eager float32 forward: log-probabilities at every
position of a prompt several windows long, 32 greedy tokens, batched = alone, preempted = uninterrupted; the
native decode step runs these layers with the Python layers' bits; the chat template renders.  GGUF files:
tests/test_gemma3_gguf.py."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import quill
from quill.cli.inspect import report
from quill.engine.core import EngineConfig, EngineCore
from quill.models.base import ForwardContext
from tests.engine_util import engine_core, greedy, hf_logprobs, scored, staggered
from tests.gemma3_util import TEXT, WINDOW, hf_gemma3, randomized  # noqa: F401
from tests.model_util import save_hf_dir

PROMPT = [int(t) for t in torch.randint(4, 320, (100,), generator=torch.Generator().manual_seed(11))]
GEMMA_TEMPLATE = (  # google/gemma-3-*-it's chat template (tokenizer_config.json), system turn folded in
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + "
    "'\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}{{ '<start_of_turn>' + role + '\n' + "
    "(first_user_prefix if loop.first else \"\") }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}")


def core(llm, **cfg) -> EngineCore:
    return engine_core(llm, **{"block_size": 8, **cfg})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_gemma3(seed=1)
    d = save_hf_dir(hf, tmp_path_factory.mktemp("gemma3"), tokenizer=False)
    return hf, quill.LLM(str(d), skip_tokenizer_init=True, kv_cache_dtype="float32")


def test_the_model_describes_gemma3(pair):
    _, llm = pair
    specs = llm.model.decoder_layer_specs()
    assert [s.attention.window for s in specs] == [WINDOW, None, WINDOW, None]
    assert [s.rope for s in specs] == ["local", "global", "local", "global"]
    assert {s.residual for s in specs} == {"sandwich-norm"} and specs[0].ffn.activation == "gelu_pytorch_tanh"
    assert specs[0].attention.scale == 20 ** -0.5 and llm.context_length == 256


@pytest.mark.parametrize("chunk", [256, 24])
def test_logprobs_match_transformers_at_every_position(pair, chunk):
    hf, llm = pair
    got = scored(llm, PROMPT, chunk, block_size=8)
    ref = hf_logprobs(hf, PROMPT)
    assert got.shape == ref.shape and (got - ref).abs().max() < 1e-3


def test_greedy_batched_and_preempted_match_transformers(pair):
    hf, llm = pair
    prompts = {str(i): PROMPT[i * 9:] for i in range(3)}
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


def test_the_native_step_runs_gemma3(pair):
    _, llm = pair
    assert llm.engine.native_step is not None, llm.engine.native_step_reason
    assert llm.engine.native_step.tables == ("local", "global")
    assert "decode step: native" in report(llm)


def step_run(llm, native_step: bool, isa: str, team: bool = True) -> dict:
    """request -> (greedy tokens, top-3 log-probabilities per token): batched sequences of different lengths,
    past the local layers' window, arriving at different steps."""
    c = EngineCore(llm.model, llm.eos_token_ids, llm.context_length,
                   EngineConfig(kv_cache_dtype="float32", block_size=8, native_step=native_step, max_num_seqs=4,
                                max_num_batched_tokens=32), isa=isa)
    assert (c.native_step is not None) == native_step, c.native_step_reason
    if native_step:
        c.native_step.team = team
    params = quill.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    return staggered(c, [PROMPT[i * 7:i * 7 + 5 + 6 * i] for i in range(3)], params, {0: [0, 1], 3: [2]})


@pytest.mark.parametrize("isa", ["native", "scalar"])
def test_the_native_step_gives_the_python_layers_bits(pair, isa):
    """Sandwich norms, gelu-tanh, q/k norms, the local layers' own rotary table and window in one native call
    (teamed and op by op), on this CPU's kernels and the scalar twins: the Python layers' bits."""
    _, llm = pair
    isa = llm.engine.cache.isa if isa == "native" else isa
    python = step_run(llm, False, isa)
    assert step_run(llm, True, isa) == python
    assert step_run(llm, True, isa, team=False) == python
    assert len(python) == 3 and all(len(t) == 24 for t, _ in python.values())


def test_multimodal_checkpoint_loads_its_text_model(tmp_path, caplog):
    import transformers
    text = hf_gemma3(seed=2)
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text.config.to_dict(), vision_config=vision, mm_tokens_per_image=4)
    mm = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    mm.model.language_model.load_state_dict(text.model.state_dict())
    mm.lm_head.load_state_dict(text.lm_head.state_dict())
    d = save_hf_dir(mm, tmp_path / "mm", tokenizer=False)
    with caplog.at_level(logging.INFO, logger="quill"):
        llm = quill.LLM(str(d), skip_tokenizer_init=True, kv_cache_dtype="float32")
    assert any("skipped" in r.getMessage() for r in caplog.records)
    assert llm.model.args.model_type == "gemma3"
    ids = torch.tensor([PROMPT[:40]])
    with torch.inference_mode():
        got = llm.model(ids, ForwardContext.causal(1, 40))
        ref = text(ids).logits
    assert (got - ref).abs().max() < 1e-4


def test_gemma_chat_template_renders(tmp_path):
    import transformers

    from quill.tokenizer import Tokenizer, hf_tokenizer_spec
    from tests.model_util import byte_tokenizer
    tok = byte_tokenizer()
    tok.add_special_tokens(["<start_of_turn>", "<end_of_turn>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": GEMMA_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>",
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello "},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]
    got = Tokenizer(hf_tokenizer_spec(tmp_path, {})).apply_chat_template(chat, add_generation_prompt=True)
    assert got == ("<s><start_of_turn>user\nBe brief.\n\nhello<end_of_turn>\n<start_of_turn>model\nhi<end_of_turn>\n"
                   "<start_of_turn>user\nagain<end_of_turn>\n<start_of_turn>model\n")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)
    assert got == ref
