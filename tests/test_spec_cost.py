"""Speculation's plan (quill.engine.spec_cost): measured step times, interpolated between the row counts seen;
drafts where they pay (a memory-bound step: nearly always; a compute-bound batch: only drafts kept nearly
always; a draft model's forwards counted), none where plain decoding is faster; and, on the default model
with the plan on, greedy output is still the non-speculative output."""

from __future__ import annotations

import pytest

from quill.engine.core import EngineConfig, EngineCore
from quill.engine.sampling import SamplingParams
from quill.engine.spec_config import SpeculativeConfig
from quill.engine.spec_cost import EWMA, Candidate, StepTimes, plan
from quill.errors import ConfigError
from tests.test_speculative import NGRAM, _mixed, llm, run  # noqa: F401 (llm: the module's fixture)

MS = 1e-3


def times(fn, rows) -> StepTimes:
    t = StepTimes()
    for n in rows:
        t.record(n, fn(n))
    return t


def test_step_times_average_interpolate_and_are_optimistic_past_what_was_seen():
    t = StepTimes()
    assert t(4) is None  # nothing measured: the plan tries speculating
    t.record(4, 10 * MS)
    assert t(4) == t(9) == 10 * MS and t(1) == 2.5 * MS  # one count: flat past it, proportional below
    t.record(4, 20 * MS)
    assert t(4) == pytest.approx((10 + EWMA * 10) * MS)  # slower: a recent average
    t.record(4, 500 * MS), t.record(4, 10 * MS)
    assert t(4) == 10 * MS  # faster: at once (a cold first step does not hold the count off)
    t.record(12, 30 * MS)
    assert t(8) == pytest.approx((t(4) + t(12)) / 2)  # linear between counts seen
    assert t(40) == t(12)  # past the largest: as the largest, so it gets tried and measured
    t.record(0, 1.0), t.record(5000, 1.0), t.record(3, 0.0)  # nothing sensible to keep
    assert t.rows == [4, 12]


def test_a_memory_bound_step_drafts_even_at_low_acceptance():
    flat = times(lambda n: 11 * MS + 0.05 * MS * n, range(1, 9))  # one stream: rows nearly free
    assert plan(1, [Candidate(0.3, 3)], flat, None) == [3]
    assert plan(1, [Candidate(0.002, 3)], flat, None) == [0]  # rows are not quite free: 0.45 % each


def test_a_compute_bound_batch_drafts_only_what_is_kept_nearly_always():
    linear = times(lambda n: 10 * MS + 2 * MS * n, range(1, 65))  # 16 streams: a row costs what a token does
    assert plan(16, [Candidate(0.5, 3)] * 16, linear, None) == [0] * 16
    # a draft pays when accept / 2 ms beats 16 tokens / 42 ms, i.e. accept^j > 0.76
    ks = plan(16, [Candidate(0.95, 3)] * 8 + [Candidate(0.5, 3)] * 8, linear, None)
    assert ks == [3] * 8 + [0] * 8  # 0.95^3 = 0.86 pays, 0.5 never does


def test_a_draft_models_forwards_are_counted():
    target = times(lambda n: 11 * MS, range(1, 9))
    draft = times(lambda n: 5 * MS, range(1, 9))  # a forward per draft position
    assert plan(1, [Candidate(0.95, 3)], target, draft) == [3]  # 3.71 tokens in 26 ms beats 1 in 11
    assert plan(1, [Candidate(0.3, 3)], target, draft) == [0]  # 1.3 tokens in 16 ms does not
    assert plan(1, [Candidate(0.3, 3)], target, None) == [3]  # the same acceptance with free drafts does


def test_the_plan_tries_what_it_has_not_measured():
    """Nothing measured: one sequence drafts (the likeliest kept); then the unmeasured step sizes look best."""
    assert plan(2, [Candidate(0.1, 3), Candidate(0.2, 2)], StepTimes(), None) == [0, 2]
    assert plan(1, [Candidate(0.9, 3)], times(lambda n: 11 * MS, [1]), StepTimes()) == [3]  # nor the draft
    below = times(lambda n: 2 * MS * n, [20])  # 16 plain rows: pro rata, 32 ms; 17-19 rows too; more: flat
    assert plan(16, [Candidate(0.5, 1)] * 4, below, None) == [0] * 4
    assert plan(16, [Candidate(0.5, 3)] * 16, below, None) == [3] * 16  # 64 rows not measured: tried


def test_adaptive_must_be_a_boolean():
    with pytest.raises(ConfigError, match=r"speculative_config.adaptive: expected true or false, found 'no'"):
        SpeculativeConfig.parse({"method": "ngram", "adaptive": "no"})
    assert "adaptive" not in SpeculativeConfig.parse({"method": "ngram"}).as_dict()  # vLLM's dict when default


def test_greedy_batch_of_16_with_the_plan_on_is_identical(llm):  # noqa: F811
    """The plan decides per step from this host's times: whatever it decides, output is the plain output."""
    prompts, params = _mixed(llm)
    config = EngineConfig(speculative=SpeculativeConfig.parse({**NGRAM, "adaptive": True}))
    spec = EngineCore(llm.model, llm.eos_token_ids, llm.context_length, config, isa=llm.engine.cache.isa,
                      grammars=llm.engine.grammars)
    plain = EngineCore(llm.model, llm.eos_token_ids, llm.context_length, EngineConfig(), isa=llm.engine.cache.isa,
                       grammars=llm.engine.grammars)
    assert run(spec, llm, prompts, params) == run(plain, llm, prompts, params)
    assert spec.speculator.step_times.rows and spec.stats().kv_blocks_used == 0  # decode steps were measured
    one = [SamplingParams(temperature=0, max_tokens=24, logprobs=0)]
    assert run(spec, llm, prompts[:1], one) == run(plain, llm, prompts[:1], one)
