"""Speculative decoding (n-gram prompt lookup) on the default model: greedy output is the non-speculative
output token for token and log-prob for log-prob (alone, in a mixed batch, under preemption, through
quill serve), sampled output keeps the non-speculative distribution, drafts are really kept on text that
repeats its prompt, and bad configurations are named before anything loads."""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import openai
import pytest
import torch

import quill
import quill.default_model as default_model
from quill.cli import main
from quill.engine.core import EngineConfig, EngineCore
from quill.engine.ngram import NgramIndex, lookup
from quill.engine.output import OutputProcessor
from quill.engine.sampling import SamplingParams, sampling_probs
from quill.engine.spec_config import SpeculativeConfig
from quill.engine.speculative import verify_token
from quill.engine.structured import StructuredOutputs
from quill.errors import ConfigError
from quill.options import RunOptions
from tests.server_util import ServerProcess

# adaptive false: every step drafts where the lookup finds something, so what these tests check runs whatever
# the host's timing (the adaptive plan's own tests: tests/test_spec_cost.py)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He lit the great lamp, "
           "wound the clockwork that turned the lens, and wrote the weather in his logbook.")
COPY = [f"Repeat this passage word for word:\n\n{PASSAGE}", f"Copy this text exactly: {PASSAGE}",
        "Count: one two three four five six seven eight nine ten, one two three four five six seven eight",
        "Write the list again: apples, pears, plums, cherries; apples, pears, plums, cherries; apples,"]
FREE = ["Name three colours.", "Say hello.", "Why is the sky blue?", "Write one sentence about the sea."]


@pytest.fixture(scope="module")
def llm():
    return quill.LLM(default_model.default_model_path(), speculative_config=NGRAM, progress=False)


def core(llm, spec: bool, **cfg) -> EngineCore:
    config = EngineConfig(speculative=SpeculativeConfig.parse(NGRAM) if spec else None, **cfg)
    return EngineCore(llm.model, llm.eos_token_ids, llm.context_length, config, isa=llm.engine.cache.isa,
                      grammars=llm.engine.grammars)


def run(c: EngineCore, llm, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    """Per request: (tokens, text, finish reason, stop reason, sampled tokens' log-probs) through the text layer."""
    proc = OutputProcessor(c, llm.tokenizer)
    states = [proc.add(f"r{i}", None, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    while proc.has_work():
        proc.step()
    return [(s.token_ids, s.text.text, s.finish_reason, s.stop_reason,
             [lp[t].logprob for lp, t in zip(s.logprobs, s.token_ids)]) for s in states]


def chat(llm, text: str) -> list[int]:
    return llm.chat_prompt([{"role": "user", "content": text}])


def test_ngram_lookup_takes_the_most_recent_longest_match():
    t = np.array([5, 1, 2, 9, 1, 2, 7, 8, 3, 1, 2], dtype=np.int64)
    assert lookup(t, 2, 1, 2) == [7, 8]  # "1 2" last seen at 4-5, followed by 7 8 (not 9 from the first)
    assert lookup(t, 5, 1, 2) == [7, 8, 3, 1, 2]
    assert lookup(np.array([4, 6, 4], dtype=np.int64), 3, 1, 3) == [6, 4]  # only n=1 occurs before
    assert lookup(np.array([1, 2, 3], dtype=np.int64), 3, 1, 3) == []  # nothing repeats
    assert lookup(np.array([1, 2, 3, 2], dtype=np.int64), 3, 2, 3) == []  # n=1 would match; below min


def test_the_incremental_index_finds_what_the_lookup_finds():
    """NgramIndex (what the proposer runs, a few dict probes a step) against lookup (the plain search) on
    sequences over a small vocabulary (many repeats) that grow by one or several tokens at a time."""
    rng = np.random.default_rng(0)
    for n_min, n_max in ((1, 3), (2, 4), (1, 1)):
        tokens = list(rng.integers(0, 6, 5))
        index = NgramIndex(n_min, n_max)
        while len(tokens) < 300:
            want = lookup(np.asarray(tokens, dtype=np.int64), 4, n_min, n_max)
            assert index.lookup(tokens, 4) == want
            tokens += list(rng.integers(0, 6, int(rng.integers(1, 4))))


def test_greedy_alone_is_token_for_token_and_drafts_are_kept(llm):
    prompt, params = [chat(llm, COPY[0])], [SamplingParams(temperature=0, max_tokens=48, logprobs=2)]
    plain, spec = core(llm, False), core(llm, True)
    want, got = run(plain, llm, prompt, params), run(spec, llm, prompt, params)
    assert got == want
    s = spec.stats()
    assert s.spec_decode_num_draft_tokens > 0 and s.spec_decode_num_accepted_tokens > 0.3 * len(want[0][0])
    assert s.kv_blocks_used == 0 and plain.stats().spec_decode_num_drafts == 0  # rolled back and all freed


def _mixed(llm) -> tuple[list[list[int]], list[SamplingParams]]:
    """16 requests: copy-heavy and free prompts, with the options a step must keep exactly."""
    prompts, params = [], []
    variants = [dict(), dict(logprobs=3), dict(repetition_penalty=1.3),
                dict(presence_penalty=0.8, frequency_penalty=0.5),
                dict(stop=[" the"]), dict(min_tokens=12, max_tokens=14), dict(logit_bias={262: 5.0}),
                dict(max_tokens=5, stop_token_ids=[28])]
    for i in range(16):  # each variant on a copy-heavy prompt and on a free one
        text = (COPY + FREE)[i // 2]
        prompts.append(chat(llm, text) if i % 4 < 2 else llm.tokenizer.encode(text))
        params.append(SamplingParams(**{"temperature": 0, "max_tokens": 20, "logprobs": 1, **variants[i % 8]}))
    return prompts, params


def test_greedy_batch_of_16_mixed_requests_is_identical(llm):
    prompts, params = _mixed(llm)
    spec = core(llm, True)
    got = run(spec, llm, prompts, params)
    assert got == run(core(llm, False), llm, prompts, params)
    assert spec.stats().spec_decode_num_accepted_tokens > 0 and spec.stats().kv_blocks_used == 0
    assert {r[3] for r in got} >= {" the"}  # a stop string ended one (inside a step that took several tokens)


def test_grammar_requests_do_not_speculate_and_answer_the_same(llm):
    """Structured outputs: the matcher cannot roll back a rejected draft, so such a request takes no drafts."""
    params = [SamplingParams(temperature=0, max_tokens=24, logprobs=0,
                             structured_outputs=StructuredOutputs(regex="(The lighthouse keeper [a-z ,.]+)"))]
    prompt = [chat(llm, COPY[0])]
    spec = core(llm, True)
    assert run(spec, llm, prompt, params) == run(core(llm, False), llm, prompt, params)
    assert spec.stats().spec_decode_num_drafts == 0


def test_greedy_under_preemption_is_identical(llm):
    prompts = [chat(llm, t) for t in (COPY[0], COPY[2], FREE[0], COPY[3])]
    params = [SamplingParams(temperature=0, max_tokens=32, logprobs=0, ignore_eos=True)] * 4
    alone = [run(core(llm, False), llm, [p], params[:1])[0] for p in prompts]
    a = llm.model.args
    per_token = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * 2  # float16 keys and values
    tight = core(llm, True, kv_cache_memory=14 * 16 * per_token)  # 14 blocks: four requests need ~20
    assert run(tight, llm, prompts, params) == alone
    s = tight.stats()
    assert s.num_preemptions > 0 and s.spec_decode_num_accepted_tokens > 0 and s.kv_blocks_used == 0


def test_the_llm_speculates_and_says_so(llm):
    out = llm.generate([{"prompt_token_ids": chat(llm, COPY[1])}], SamplingParams(temperature=0, max_tokens=40))[0]
    assert out.finish_reason in ("stop", "length") and out.text
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
    assert llm.arithmetic["speculation"].startswith("ngram, up to 3 draft tokens")
    assert llm.options.speculative_config == NGRAM


# ---- sampling: the rejection rule keeps the distribution --------------------------------------------------
def test_the_rejection_rule_gives_the_target_distribution():
    """verify_token against synthetic targets: the law of what it returns must be p exactly (8000 draws a draft,
    a chi-square test); accepting every draft, or drawing a rejected position from p instead of p minus
    the draft, fails it."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.tensor([2.0, 1.5, 0.3, -1.0, 0.9, -0.2])
    params = SamplingParams(temperature=0.8, top_k=5)
    p = sampling_probs(logits, params)
    for draft in (0, 1, 3):  # the favourite, a middling token, one top-k removes (p = 0)
        n = 8_000
        counts = torch.bincount(torch.tensor([verify_token(logits, params, draft, gen) for _ in range(n)]),
                                minlength=6).double()
        expected = p.double() * n
        keep = expected > 0
        assert counts[~keep].sum() == 0, draft  # a token the filters removed never comes out
        chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
        assert chi2 < 25.0, (draft, chi2, counts.tolist(), expected.tolist())  # df 4: p < 1e-4


def test_sampled_tokens_keep_the_non_speculative_distribution(llm):
    """On the model: with a draft on the table, the token at the verified position must follow the
    distribution ordinary sampling draws from there, over many seeds.  Accepting every draft fails it by
    far (chi-square ~100 against ~20)."""
    prompt = llm.tokenizer.encode("Count again: one two three four five six seven eight nine ten, one two three four "
                                  "five six seven eight nine ten, one two three four five six seven eight")
    n = 160
    spec = core(llm, True, max_num_seqs=n, max_num_batched_tokens=4 * n)
    counted = assert_sampled_like_plain(spec, core(llm, False), prompt, n, temperature=1.5)
    assert spec.stats().spec_decode_num_draft_tokens >= counted  # each had a draft on the table


def assert_sampled_like_plain(spec: EngineCore, plain: EngineCore, prompt: list[int], n: int,
                              temperature: float) -> int:
    """``n`` requests (seeds 0 .. n - 1) sample 3 tokens after ``prompt`` on ``spec``; among those whose first
    token is the commonest, the second (a verified position when a draft was on the table) must follow the
    distribution ordinary sampling draws from there, computed exactly from ``plain``'s log-probs (a
    chi-square test, p = 1e-3).  How many second tokens it counted."""
    assert len(prompt) % 16 == 1  # all but the last token from the prefix cache: one prefill row a request
    spec.add_request("warm", prompt, SamplingParams(temperature=0, max_tokens=1))  # the prompt's blocks cached
    list(_drain(spec))
    for i in range(n):
        spec.add_request(str(i), prompt, SamplingParams(temperature=temperature, max_tokens=3, seed=i, ignore_eos=True))
    seqs: dict[str, list[int]] = {}
    for o in _drain(spec):
        seqs.setdefault(o.request_id, []).extend(o.new_token_ids)
    firsts = [s[0] for s in seqs.values()]
    first = max(set(firsts), key=firsts.count)
    second = [s[1] for s in seqs.values() if s[0] == first]
    # what a non-speculative request samples from after prompt + first: from the raw log-probs of every token
    plain.add_request("x", prompt + [first], SamplingParams(temperature=0, max_tokens=1, logprobs=-1))
    lps = next(_drain(plain)).logprobs[0]
    p = sampling_probs(torch.tensor([lps[t].logprob for t in range(len(lps))]),
                       SamplingParams(temperature=temperature)).double()
    counts = torch.bincount(torch.tensor(second), minlength=p.numel()).double()
    expected = p * len(second)
    big = expected >= 5  # chi-square cells; the rest pooled into one
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    expected = torch.cat([expected[big], expected[~big].sum().view(1)])
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < chi2_critical(int(big.sum()), z=3.09), (chi2, observed.tolist(), expected.tolist())  # p 1e-3
    return len(second)


def chi2_critical(df: int, z: float) -> float:
    """The chi-square quantile with ``df`` degrees of freedom above which lies the normal tail beyond ``z``
    (Wilson-Hilferty; z 3.09: p = 1e-3)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _drain(c: EngineCore):
    while c.has_unfinished_requests():
        yield from c.step()


# ---- configuration ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, words", [
    ({"method": "eagle"}, r"speculative_config.method: unknown method 'eagle'; supported: ngram, draft_model"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens: expected an integer >= 1, found 0"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, r"prompt_lookup_min: 4 is above "
                                                                           r"prompt_lookup_max 2"),
    ({"method": "ngram", "lookahead": 2}, r"unknown key\(s\) lookahead; supported: method"),
    ("{not json", r"speculative_config: not valid JSON"),
    ([1, 2], r"speculative_config: expected a JSON object"),
])
def test_bad_configurations_are_named_before_loading(value, words):
    with pytest.raises(ConfigError, match=words):
        RunOptions(speculative_config=value)
    with pytest.raises(ConfigError, match=words):  # before the (missing) model is looked for
        quill.LLM("/nonexistent/model.gguf", speculative_config=value)


def test_vllm_spellings_and_the_flag(capsys):
    assert RunOptions(speculative_config='{"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 4}'
                      ).speculative_config == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                                               "prompt_lookup_max": 4}
    assert main(["generate", "hi", "--speculative-config", '{"method": "draft_model"}']) == 2
    assert "speculative_config.model: missing" in capsys.readouterr().err


# ---- through quill serve --------------------------------------------------------------------------------------
def test_serve_with_speculation_answers_the_same_and_reports_it(llm):
    prompt = COPY[0]
    want = run(core(llm, False), llm, [llm.tokenizer.encode(prompt)], [SamplingParams(temperature=0, max_tokens=40)])
    with ServerProcess("--speculative-config", json.dumps(NGRAM), "--max-num-seqs", "4") as s:
        assert any("speculation: ngram" in line for line in s.lines)  # the load line
        client = openai.OpenAI(base_url=s.base_url, api_key="none")
        got = client.completions.create(model=s.name, prompt=prompt, max_tokens=40, temperature=0)
        assert got.choices[0].text == want[0][1]
        metrics = httpx.get(s.url + "/metrics").text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith(("vllm:spec_decode", "quill_spec_decode"))}
    assert values["vllm:spec_decode_num_draft_tokens_total"] > 0
    assert 0 < values["vllm:spec_decode_num_accepted_tokens_total"] <= values["vllm:spec_decode_num_draft_tokens_total"]
    assert 0 < values["vllm:spec_decode_draft_acceptance_rate"] <= 1
    assert values["quill_spec_decode_mean_acceptance_length"] > 1
