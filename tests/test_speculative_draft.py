"""Speculative decoding with a draft model: the default model drafting for itself (every draft kept) and
for a Q8_0 copy of itself written by llama.cpp's quantizer; greedy output is the non-speculative output
token for token (alone, in a mixed batch of 16, under preemption, through quill serve), sampled output
keeps the non-speculative distribution, a draft run ends at EOS or a stop token, a draft whose forward
fails costs no request anything, the draft's blocks all come back, and bad configurations are named
before anything loads."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

import quill
import quill.default_model as default_model
from quill.cli import main
from quill.engine.core import EngineConfig, EngineCore
from quill.engine.draft import vocabulary
from quill.engine.sampling import SamplingParams
from quill.engine.spec_config import SpeculativeConfig
from quill.engine.speculative import PROPOSER_FAULTS
from quill.errors import ConfigError
from quill.options import RunOptions
from tests.llamacpp_util import quantize
from tests.server_util import ServerProcess
from tests.test_speculative import COPY, FREE, _mixed, assert_sampled_like_plain, chat, run

SMOL = str(default_model.default_model_path())


def draft_config(k: int = 3) -> dict:
    """adaptive false: every step drafts (the forward counts below are exact); the plan: tests/test_spec_cost.py."""
    return {"method": "draft_model", "model": SMOL, "num_speculative_tokens": k, "adaptive": False}


@pytest.fixture(scope="module")
def llm():
    """The default model drafting for itself."""
    return quill.LLM(SMOL, speculative_config=draft_config(), progress=False)


@pytest.fixture(scope="module")
def q8(tmp_path_factory) -> quill.LLM:
    """A Q8_0 copy of the default model (llama.cpp's quantizer), the default model's Q4_1 drafting for it."""
    path = quantize(default_model.default_model_path(), tmp_path_factory.mktemp("draft") / "smol-q8_0.gguf", "Q8_0")
    return quill.LLM(str(path), speculative_config=draft_config(), progress=False)


def core(llm, spec: bool, draft=None, **cfg) -> EngineCore:
    """An engine on ``llm``'s model, drafting with ``draft`` (default: ``llm``'s own) when ``spec``."""
    config = EngineConfig(speculative=SpeculativeConfig.parse(draft_config()) if spec else None, **cfg)
    return EngineCore(llm.model, llm.eos_token_ids, llm.context_length, config, isa=llm.engine.cache.isa,
                      grammars=llm.engine.grammars, draft=(llm.draft if draft is None else draft) if spec else None)


class ProbedDraft:
    """The real draft model behind a fault-injection hook: its forward raises on the calls ``fail(n)`` picks
    (n counts from 1); everything else is the model's own.  Counts the forwards and the tokens they ran."""

    def __init__(self, model, fail: Callable[[int], bool] = lambda n: False):
        self.model, self.fail, self.calls, self.tokens = model, fail, 0, 0

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, tokens, ctx):
        self.calls += 1
        if self.fail(self.calls):
            raise RuntimeError(f"injected draft fault on call {self.calls}")
        self.tokens += tokens.shape[1]
        return self.model(tokens, ctx)


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


def test_the_draft_reads_a_prompt_as_it_finishes(llm):
    """The step that finishes a prompt also runs it through the draft (its wait falls before the first token, as
    in llama-server), so the first proposal feeds the draft one token: one decode row, not the prompt."""
    draft = ProbedDraft(llm.draft)
    spec = core(llm, True, draft)
    prompt = chat(llm, COPY[0])
    spec.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=24))
    spec.step()  # the whole prompt (one chunk) and its first token
    [st] = spec.speculator.proposer.states.values()
    assert draft.calls == 1 and draft.tokens == len(prompt) and st.tokens == prompt
    spec.step()  # the first proposal: the first token, then two fed-back drafts
    assert draft.calls == 4 and draft.tokens == len(prompt) + 3 and spec.stats().spec_decode_num_drafts == 1


@pytest.mark.parametrize("per_row, reads", [(0.0, True), (2e-3, False)])
def test_a_prompt_is_read_only_where_the_plan_would_draft(llm, per_row, reads):
    """With the plan on, a finished prompt goes through the draft only if a step of the running sequences would
    draft for it: on memory-bound steps (rows nearly free) it does, on compute-bound ones (a row costs what a
    token does, the draft's forward more than the target's row) the draft is not run for nothing."""
    draft = ProbedDraft(llm.draft)
    config = EngineConfig(speculative=SpeculativeConfig.parse({**draft_config(), "adaptive": True}))
    spec = EngineCore(llm.model, llm.eos_token_ids, llm.context_length, config, isa=llm.engine.cache.isa,
                      draft=draft)
    for n in range(1, 9):  # this host's times, as if measured
        spec.speculator.step_times.record(n, 1e-3 + per_row * n)
        spec.speculator.proposer.times.record(n, 5e-3 * bool(per_row) + 1e-4)
    spec.add_request("a", chat(llm, COPY[0]), SamplingParams(temperature=0, max_tokens=8))
    spec.step()
    assert draft.calls == int(reads)


# ---- a draft that fails ---------------------------------------------------------------------------------------
def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "quill.engine" and r.levelno == logging.WARNING]


def test_a_failing_draft_forward_ends_speculation_not_the_requests(llm, caplog):
    """The draft's 5th forward raises (step 3's first: the prompts were read as they finished, step 2 drafted): the
    two requests it drafted for go on without drafts, token for token as without speculation, one warning
    names the error, the draft's blocks all come back, and a later request speculates again."""
    prompts = [chat(llm, FREE[2]), chat(llm, COPY[0])]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 2
    want = run(core(llm, False), llm, prompts, params)
    draft = ProbedDraft(llm.draft, fail=lambda n: n == 5)
    spec = core(llm, True, draft)
    with caplog.at_level(logging.WARNING, logger="quill.engine"):
        assert run(spec, llm, prompts, params) == want
    [warning] = _warnings(caplog)
    assert "draft_model proposer failed (RuntimeError: injected draft fault on call 5); request r0, " \
           "request r1 go on without drafts" in warning
    s = spec.stats()
    assert draft.calls == 5  # step 1: the prompts; step 2: the first tokens and two fed-back drafts; step 3 failed
    assert s.spec_decode_num_drafts == 2 and s.spec_decode_num_accepted_tokens == s.spec_decode_num_draft_tokens == 6
    assert draft_blocks_used(spec) == 0 and s.kv_blocks_used == 0
    assert run(spec, llm, prompts[:1], params[:1]) == want[:1]  # a new request: drafts again
    assert draft.calls > 5 and spec.stats().spec_decode_num_drafts > 2


def test_a_draft_that_keeps_failing_is_switched_off(llm, caplog):
    """Every draft forward raises: each request still answers as without speculation; after PROPOSER_FAULTS
    failures in a row the engine stops drafting (no forward wasted on each new request), and says so."""
    prompt, params = [chat(llm, FREE[0])], [SamplingParams(temperature=0, max_tokens=6)]
    want = run(core(llm, False), llm, prompt, params)
    draft = ProbedDraft(llm.draft, fail=lambda n: True)
    spec = core(llm, True, draft)
    with caplog.at_level(logging.WARNING, logger="quill.engine"):
        for _ in range(PROPOSER_FAULTS + 1):
            assert run(spec, llm, prompt, params) == want
    warnings = _warnings(caplog)
    assert draft.calls == len(warnings) == PROPOSER_FAULTS  # one failed forward a request, then none
    assert "speculation is now off for this engine (3 failures in a row)" in warnings[-1]
    assert "now off" not in warnings[0] and spec.stats().spec_decode_num_drafts == 0


# ---- a draft run ends where the request would -------------------------------------------------------------------
def test_a_draft_run_ends_at_eos_or_a_stop_token(llm):
    """A draft after a token that finishes the request is never kept: drafting for itself without ignore_eos,
    the default model keeps every token it drafts (it would not if runs went on past EOS / the stop token)."""
    prompts = [chat(llm, FREE[1]), chat(llm, FREE[0])]
    free = run(core(llm, False), llm, prompts[1:], [SamplingParams(temperature=0, max_tokens=40)])[0][0]
    stop = next(t for i, t in enumerate(free) if i >= 6 and t not in free[:i])  # a token first seen mid-answer
    params = [SamplingParams(temperature=0, max_tokens=40), SamplingParams(temperature=0, max_tokens=40,
                                                                           stop_token_ids=[stop])]
    want = run(core(llm, False), llm, prompts, params)
    assert [w[2] for w in want] == ["stop", "stop"] and want[1][3] == stop  # EOS, then the stop token
    draft = ProbedDraft(llm.draft)
    spec = core(llm, True, draft)
    assert run(spec, llm, prompts, params) == want
    s = spec.stats()
    assert s.spec_decode_num_accepted_tokens == s.spec_decode_num_draft_tokens > 10


# ---- sampling ---------------------------------------------------------------------------------------------------
def test_sampled_tokens_keep_the_non_speculative_distribution(llm):
    """Temperature > 0: the token at a position the draft model drafted follows the distribution ordinary
    sampling draws from there (tests.test_speculative's chi-square test over 100 seeds).  A one-token prompt:
    the draft prefills every request's prompt itself, and after it the model's second token is spread
    (its favourite ~0.3), so accepting every draft fails the test by far (chi-square 121 against 11.2 at p = 1e-3)."""
    prompt = llm.tokenizer.encode("Recipe")
    n = 100
    spec = core(llm, True, max_num_seqs=n, max_num_batched_tokens=4 * n)
    assert_sampled_like_plain(spec, core(llm, False), prompt, n, temperature=1.0)
    assert spec.stats().spec_decode_num_draft_tokens == n  # every request had a draft at its second token


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


# ---- through quill serve --------------------------------------------------------------------------------------
def test_serve_with_a_draft_model_answers_the_same_and_reports_it(llm):
    """One server drafting with the default model for itself: greedy completions (streamed and not) and a
    streamed chat answer as an engine without speculation does; /metrics counts drafted and accepted tokens
    under vLLM's names (every draft kept: the draft is the target, and a run ends at EOS)."""
    prompt, question = COPY[1], FREE[2]
    greedy = [SamplingParams(temperature=0, max_tokens=24)]
    want = run(core(llm, False), llm, [llm.tokenizer.encode(prompt)], greedy)[0][1]
    want_chat = run(core(llm, False), llm, [chat(llm, question)], greedy)[0][1]
    with ServerProcess("--speculative-config", json.dumps(draft_config()), "--max-num-seqs", "4") as s:
        assert any(f"speculation: draft_model {SMOL}" in line for line in s.lines)  # the load line
        client = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0, timeout=120)
        got = client.completions.create(model=s.name, prompt=prompt, max_tokens=24, temperature=0)
        streamed = client.completions.create(model=s.name, prompt=prompt, max_tokens=24, temperature=0, stream=True)
        chat_stream = client.chat.completions.create(model=s.name, messages=[{"role": "user", "content": question}],
                                                     max_tokens=24, temperature=0, stream=True)
        assert got.choices[0].text == want
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want
        assert "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices) == want_chat
        m = s.metrics()
    assert m["vllm:spec_decode_num_drafts_total"] > 0
    assert m["vllm:spec_decode_num_accepted_tokens_total"] == m["vllm:spec_decode_num_draft_tokens_total"] > 10
    assert m["vllm:spec_decode_draft_acceptance_rate"] == 1.0 and m["quill_spec_decode_mean_acceptance_length"] > 2
