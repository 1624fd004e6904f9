"""Speculative decoding with a draft model: the default model drafting for itself (every draft kept) and
for a Q8_0 copy of itself written by llama.cpp's quantizer; greedy output is the non-speculative output
token for token (alone, in a mixed batch of 16, under preemption), the draft's blocks all come back, and
bad configurations are named before anything loads."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import quill
import quill.default_model as default_model
from quill.cli import main
from quill.engine.core import EngineConfig, EngineCore
from quill.engine.draft import vocabulary
from quill.engine.sampling import SamplingParams
from quill.engine.spec_config import SpeculativeConfig
from quill.errors import ConfigError
from quill.options import RunOptions
from tests.llamacpp_util import quantize
from tests.test_speculative import COPY, FREE, _mixed, chat, run

SMOL = str(default_model.default_model_path())


def draft_config(k: int = 3) -> dict:
    return {"method": "draft_model", "model": SMOL, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def llm():
    """The default model drafting for itself."""
    return quill.LLM(SMOL, speculative_config=draft_config(), progress=False)


@pytest.fixture(scope="module")
def q8(tmp_path_factory) -> quill.LLM:
    """A Q8_0 copy of the default model (llama.cpp's quantizer), the default model's Q4_1 drafting for it."""
    path = quantize(default_model.default_model_path(), tmp_path_factory.mktemp("draft") / "smol-q8_0.gguf", "Q8_0")
    return quill.LLM(str(path), speculative_config=draft_config(), progress=False)


def core(llm, spec: bool, **cfg) -> EngineCore:
    config = EngineConfig(speculative=SpeculativeConfig.parse(draft_config()) if spec else None, **cfg)
    return EngineCore(llm.model, llm.eos_token_ids, llm.context_length, config, isa=llm.engine.cache.isa,
                      grammars=llm.engine.grammars, draft=llm.draft if spec else None)


def draft_blocks_used(c: EngineCore) -> int:
    return c.speculator.proposer.kv.num_used


def test_drafting_for_itself_keeps_every_draft(llm):
    # ignore_eos: a draft past a finishing token cannot be kept, whoever drafted it
    prompt, params = [chat(llm, FREE[2])], [SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)]
    spec = core(llm, True)
    got = run(spec, llm, prompt, params)
    assert got == run(core(llm, False), llm, prompt, params)
    s = spec.stats()
    assert s.spec_decode_num_draft_tokens > 10  # free text too: the draft is the target
    assert s.spec_decode_num_accepted_tokens == s.spec_decode_num_draft_tokens
    assert s.kv_blocks_used == 0 and draft_blocks_used(spec) == 0


def test_the_llm_loads_the_draft_and_says_so(llm):
    out = llm.generate(FREE[0], SamplingParams(temperature=0, max_tokens=8))
    assert out[0].text and llm.engine.stats().spec_decode_num_accepted_tokens > 0
    line = llm.arithmetic["speculation"]
    assert line.startswith(f"draft_model {SMOL}, up to 3 tokens") and "KV budget split by bytes per token" in line
    assert llm.engine.draft_cache.num_blocks == llm.engine.blocks.num_blocks


def _short(params: list[SamplingParams]) -> list[SamplingParams]:
    """The mixed batch's options with fewer tokens (the test suite's time: issue 36)."""
    return [dataclasses.replace(p, max_tokens=min(p.max_tokens, 12), min_tokens=min(p.min_tokens, 8)) for p in params]


def test_q4_1_drafting_for_q8_0_alone_and_in_a_batch_of_16(q8):
    prompts, params = _mixed(q8)
    params = _short(params)
    spec = core(q8, True)
    alone = run(spec, q8, prompts[:1], params[:1])
    assert alone == run(core(q8, False), q8, prompts[:1], params[:1])
    got = run(spec, q8, prompts, params)
    assert got == run(core(q8, False), q8, prompts, params)
    s = spec.stats()
    assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens  # another model: not all kept
    assert {r[3] for r in got} >= {" the"}  # a stop string ended one
    assert s.kv_blocks_used == 0 and draft_blocks_used(spec) == 0


def test_under_preemption_is_identical(q8):
    prompts = [chat(q8, t) for t in (COPY[0], COPY[2], FREE[0])]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 3
    want = run(core(q8, False), q8, prompts, params)
    a, d = q8.model.args, q8.draft.args
    per_token = 2 * 2 * (a.num_hidden_layers * a.num_key_value_heads * a.head_dim
                         + d.num_hidden_layers * d.num_key_value_heads * d.head_dim)  # float16 k and v, both
    tight = core(q8, True, kv_cache_memory=10 * 16 * per_token)  # 10 blocks each: the three need ~12
    assert run(tight, q8, prompts, params) == want
    s = tight.stats()
    assert s.num_preemptions > 0 and s.spec_decode_num_accepted_tokens > 0
    assert s.kv_blocks_used == 0 and draft_blocks_used(tight) == 0


def test_an_aborted_request_gives_its_draft_blocks_back(llm):
    spec = core(llm, True)
    spec.add_request("a", chat(llm, COPY[0]), SamplingParams(temperature=0, max_tokens=24))
    while not spec.stats().spec_decode_num_drafts:
        spec.step()
    assert draft_blocks_used(spec) > 0
    spec.abort_request("a")
    assert draft_blocks_used(spec) == 0 and spec.stats().kv_blocks_used == 0


# ---- configuration ------------------------------------------------------------------------------------------
def _other_vocab(tmp_path: Path) -> Path:
    """A directory whose tokenizer.json is the default model's vocabulary with token 300 changed."""
    tokens = vocabulary(Path(SMOL))
    tokens[300] = "zzzz-not-smol"
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {t: i for i, t in enumerate(tokens)}}}))
    return tmp_path


@pytest.mark.parametrize("value, words", [
    ({"method": "draft_model"}, r"speculative_config.model: missing"),
    ({"method": "draft_model", "model": "/nonexistent/draft.gguf"}, r"speculative_config.model: "
                                                                    r"/nonexistent/draft.gguf: no such file"),
    ({"method": "draft_model", "model": SMOL, "num_speculative_tokens": 0}, r"num_speculative_tokens: expected an "
                                                                             r"integer >= 1, found 0"),
])
def test_bad_draft_configurations_are_named_before_loading(value, words):
    with pytest.raises(ConfigError, match=words):
        RunOptions(speculative_config=value)
    with pytest.raises(ConfigError, match=words):
        quill.LLM("/nonexistent/model.gguf", speculative_config=value)


def test_a_draft_with_another_tokenizer_is_refused_before_loading(tmp_path):
    other = _other_vocab(tmp_path)
    with pytest.raises(ConfigError, match=r"speculative_config.model: the draft .*'s token 300 is 'zzzz-not-smol'"):
        quill.LLM(SMOL, speculative_config={"method": "draft_model", "model": str(other)})


def test_vllm_older_spelling_a_model_path_alone_is_a_draft_model():
    options = RunOptions(speculative_config=json.dumps({"model": SMOL, "num_speculative_tokens": 2}))
    assert options.speculative_config["method"] == "draft_model"
    assert options.speculative_config["model"] == SMOL


def test_the_flag_reaches_the_check(capsys):
    """--speculative-config on generate: a draft that does not exist is named before the target loads (the
    load line's words are the LLM's ``arithmetic``, checked above; a second load here would cost ~2 s)."""
    config = {"method": "draft_model", "model": "/nonexistent/draft.gguf"}
    assert main(["generate", "--max-tokens", "2", "--speculative-config", json.dumps(config), "hi"]) == 2
    assert "speculative_config.model: /nonexistent/draft.gguf: no such file" in capsys.readouterr().err
