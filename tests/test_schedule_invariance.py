"""Greedy output does not depend on how a prompt was scheduled: chunked at any token, partly taken from
the prefix cache, or preempted and recomputed, the default model (GGUF Q4_1, llama.cpp's int8 activations,
native kernels) gives the same tokens and the same log-probabilities, bit for bit.

Prefill and decode attention are different kernels that round differently; int8 activations turn a
one-ulp difference into a different rounding of a whole 32-value block, so a token attended by the
wrong one moved log-probs by up to 2.0 and changed greedy text (a Ray replica's answer differed from
the offline one when the server's 128-token budget left one prompt token for the next step).
"""
import pytest

import quill
import quill.default_model as default_model
from quill.engine.core import EngineConfig, EngineCore
from quill.engine.kv_cache import StepLayout

QUESTION = "Why is the sky blue? [18]"


@pytest.fixture(scope="module")
def llm():
    return quill.LLM(default_model.default_model_path(), threads=1)


def core(llm, **cfg) -> EngineCore:
    return EngineCore(llm.model, llm.eos_token_ids, llm.context_length, EngineConfig(**cfg), isa=llm.engine.cache.isa)


def greedy(c: EngineCore, prompts: dict[str, list[int]], max_tokens: int = 24) -> dict[str, list[tuple[int, float]]]:
    """request id -> [(token, its log-prob)] for greedy requests all added at once."""
    for rid, p in prompts.items():
        c.add_request(rid, p, quill.SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, ignore_eos=True))
    out: dict[str, list[tuple[int, float]]] = {rid: [] for rid in prompts}
    while c.has_unfinished_requests():
        for o in c.step():
            for t, lp in zip(o.new_token_ids, o.logprobs):
                out[o.request_id].append((t, lp[t].logprob))
    return out


def test_layout_picks_the_kernel_by_what_a_token_is():
    table = [7, 3, 9]  # block size 16: positions 0-15 in block 7, 16-31 in 3, 32-47 in 9
    # the last prompt token alone in its chunk: a one-token prefill, not a decode
    lay = StepLayout.build([(table, 39, 1, 40)], 16)
    assert [(s, n) for s, n, _ in lay.prefills] == [(0, 1)] and lay.decode_rows.numel() == 0
    assert lay.prefills[0][2].tolist() == [7 * 16 + i for i in range(16)] + [3 * 16 + i for i in range(16)] + \
        [9 * 16 + i for i in range(8)]
    # a recompute after preemption: two prompt tokens (prefill) then three generated ones (decode rows)
    lay = StepLayout.build([(table, 38, 5, 40)], 16)
    assert [(s, n) for s, n, _ in lay.prefills] == [(0, 2)]
    assert lay.decode_rows.tolist() == [2, 3, 4] and lay.decode_lens.tolist() == [41, 42, 43]
    assert lay.slots.tolist() == [9 * 16 + 6 + i for i in range(5)]
    assert not lay.one_row_per_sequence(1)
    # a decode step: one row per sequence
    lay = StepLayout.build([(table, 40, 1, 40), ([5], 3, 1, 2)], 16)
    assert lay.one_row_per_sequence(2) and lay.decode_lens.tolist() == [41, 4]


def test_chunking_at_any_token_gives_the_same_bits(llm):
    prompt = llm.chat_prompt([{"role": "user", "content": QUESTION}])
    assert len(prompt) == 40
    want = greedy(core(llm, enable_prefix_caching=False), {"x": prompt})["x"]
    for budget in (39, 13, 7, 1):  # 39 and 13 leave the last prompt token alone in a step
        got = greedy(core(llm, enable_prefix_caching=False, max_num_batched_tokens=budget), {"x": prompt})["x"]
        assert got == want, budget


def test_a_prefix_cache_hit_gives_the_same_bits(llm):
    prompt = llm.chat_prompt([{"role": "user", "content": QUESTION}])[:33]  # 32 cached, one left to compute
    want = greedy(core(llm, enable_prefix_caching=False), {"x": prompt})["x"]
    c = core(llm)
    greedy(c, {"warm": prompt}, max_tokens=1)
    got = greedy(c, {"x": prompt})["x"]
    assert c.stats().prefix_cache_hit_tokens == 32
    assert got == want


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_and_recomputed_gives_the_same_bits(llm, prefix_caching):
    prompts = {str(i): llm.chat_prompt([{"role": "user", "content": f"{q} [{i}]"}])
               for i, q in enumerate(["Name three colours.", "Write one sentence about the sea.", "Say hello.",
                                      "Why is the sky blue?"])}
    alone = {rid: greedy(core(llm, enable_prefix_caching=False), {rid: p}, 40)[rid] for rid, p in prompts.items()}
    a = llm.model.args
    per_token = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * 2  # float16 keys and values
    tight = core(llm, kv_cache_memory=9 * 16 * per_token, enable_prefix_caching=prefix_caching)  # 9 blocks
    got = greedy(tight, prompts, 40)
    assert tight.stats().num_preemptions > 0
    assert got == alone
