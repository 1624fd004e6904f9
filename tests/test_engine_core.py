"""The engine core: block manager, scheduler (continuous batching, chunked prefill, preemption), prefix cache.

Oracle for tokens: greedy decoding by the model's plain cache-less forward
(``ForwardContext.causal`` over the whole sequence each step), which shares no code
with the paged cache, the scheduler or the block tables.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quill
from quill.engine import core as core_module
from quill.engine.block_manager import BlockManager
from quill.engine.core import EngineConfig, EngineCore
from quill.engine.output import RequestFailed
from quill.engine.sequence import Sequence
from quill.errors import GenerationError
from quill.models.base import ForwardContext
from tests.model_util import hf_model, save_hf_dir

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 99, 42, 8], list(range(20, 57)), [7] * 3, list(range(100, 119)), [250, 3, 9, 77, 31, 64, 12]]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    hf = hf_model("llama", seed=33)
    d = save_hf_dir(hf, tmp_path_factory.mktemp("engine") / "llama")
    return quill.LLM(str(d), kernel="reference", skip_tokenizer_init=True, kv_cache_dtype="float32")


def plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]), ForwardContext.causal(1, len(ids)), all_logits=False)
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def oracle(llm):
    return {i: plain_greedy(llm.model, p, 12) for i, p in enumerate(PROMPTS)}


def engine(llm, **cfg) -> EngineCore:
    # a float32 cache: the oracle is the plain float32 forward
    return EngineCore(llm.model, llm.eos_token_ids, llm.context_length,
                      EngineConfig(**{"kv_cache_dtype": "float32", **cfg}))


def run(core: EngineCore, arrivals: dict[int, list[tuple[str, list[int]]]], max_tokens: int = 12) -> dict:
    """Step the core, adding requests at the given step numbers; request id -> (tokens, finish reason)."""
    out: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    step = 0
    while core.has_unfinished_requests() or arrivals:
        for rid, prompt in arrivals.pop(step, []):
            core.add_request(rid, prompt, quill.SamplingParams(max_tokens=max_tokens, **GREEDY))
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                reasons[o.request_id] = o.finish_reason
        step += 1
        assert step < 10_000
    return {rid: (toks, reasons.get(rid)) for rid, toks in out.items()}


# ---- block manager -----------------------------------------------------------------------------

def seq(prompt, rid="r"):
    return Sequence(rid, list(prompt), quill.SamplingParams(), torch.Generator(), 0)


def test_block_allocation_and_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10))
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert len(a.block_table) == 3 and bm.num_used == 3 and a.num_cached == 0
    a.num_computed = 10
    assert bm.can_append(a)
    a.output = [1, 2]  # tokens 10, 11 fill block 2
    bm.append_slot(a)
    assert len(a.block_table) == 3
    a.output.append(3)  # token 12 needs a fourth block
    bm.append_slot(a)
    assert len(a.block_table) == 4 and bm.num_used == 4
    bm.free_blocks(a)
    assert bm.num_used == 0 and a.block_table == []


def test_a_batched_decode_preempted_by_a_later_one_leaves_the_step():
    """Preemption takes the newest by arrival, which need not come last in ``running`` (a readmitted sequence keeps
    its arrival and goes to the back): the decode loop may preempt one it already batched, which must leave the
    step (its blocks are gone)."""
    from quill.engine.scheduler import Scheduler
    from quill.engine.sequence import Status

    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    newer, older = seq(range(3), "newer"), seq(range(4), "older")
    newer.arrival, older.arrival = 5, 3
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
    for s in (newer, older):
        bm.allocate(s)
        s.status = Status.RUNNING
        sched.running.append(s)
    newer.num_computed = 2  # decoding token 2: its block has room
    older.num_computed, older.output = 4, [9]  # decoding token 4: needs a second block, and none is free
    batch = sched.schedule()
    assert newer.status is Status.WAITING and newer.block_table == [] and sched.num_preemptions == 1
    assert batch == [(older, 1)]


def test_prefix_hits_misses_and_lru_eviction():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq(range(12), "a")
    bm.allocate(a)
    a.num_computed = 12
    bm.register_computed(a)  # three full computed blocks keyed
    a_blocks = list(a.block_table)
    bm.free_blocks(a)
    assert bm.num_used == 0 and bm.num_cached_free == 3
    b = seq(list(range(8)) + [99, 98, 97], "b")  # shares the first two blocks only
    bm.allocate(b)
    assert b.num_cached == 8 and b.block_table[:2] == a_blocks[:2]
    assert bm.hit_tokens == 8
    c = seq([50] * 12, "c")  # a miss: no shared prefix
    bm.allocate(c)
    assert c.num_cached == 0
    # the pool is now 3 (b) + 3 (c) = 6 blocks: a's third block was the least recently used and is gone
    assert bm.num_free == 0
    d = seq(range(12), "d")
    assert not bm.can_allocate(d)
    bm.free_blocks(c)
    bm.allocate(d)
    assert d.num_cached == 8  # a's first two blocks (shared with b) still hit; the third was evicted


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 5), st.integers(1, 40)),
                max_size=40))
def test_cached_free_counter_tracks_the_free_list(ops):
    """The O(1) count of free blocks holding prefix content equals a walk of the free list, whatever happens."""
    bm = BlockManager(num_blocks=12, block_size=4)
    live: dict[int, Sequence] = {}
    for op, key, n in ops:
        if op == "add" and key not in live:
            s = seq([key % 3] * n, rid=str(key))  # shared leading tokens: prefix hits
            if bm.can_allocate(s):
                bm.allocate(s)
                s.num_computed = s.num_tokens
                bm.register_computed(s)
                live[key] = s
        elif op == "grow" and key in live:
            s = live[key]
            if bm.can_append(s):
                s.output.append(n)
                bm.append_slot(s)
                s.num_computed = s.num_tokens
                bm.register_computed(s)
        elif op == "free" and key in live:
            bm.free_blocks(live.pop(key))
        assert bm.num_cached_free == sum(1 for b in bm.free if bm.key[b] is not None)


def test_a_whole_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(range(8), "a")
    bm.allocate(a)
    a.num_computed = 8
    bm.register_computed(a)
    bm.free_blocks(a)
    b = seq(range(8), "b")
    bm.allocate(b)
    assert b.num_cached == 4  # block 2 would leave nothing to compute: it is recomputed


def test_usage_counts_cached_prompt_tokens_of_the_first_admission_only():
    # preempted and readmitted, a request hits the blocks it wrote itself (its output's too): those are
    # recomputation saved, not prompt tokens a client had cached
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(6), "a")
    bm.allocate(a)
    assert a.num_cached == 0
    a.output = [7, 8, 9, 10]
    bm.append_slot(a)
    a.num_computed = 10
    bm.register_computed(a)
    bm.free_blocks(a)
    a.restart()
    bm.allocate(a)
    assert a.num_computed == 8 and a.num_cached == 0 and bm.hit_tokens == 8


def test_prompt_logprobs_bypass_the_prefix_cache():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(range(8), "a")
    bm.allocate(a)
    a.num_computed = 8
    bm.register_computed(a)
    bm.free_blocks(a)
    b = Sequence("b", list(range(8)), quill.SamplingParams(prompt_logprobs=1), torch.Generator(), 1)
    bm.allocate(b)
    assert b.num_cached == 0


# ---- the engine ------------------------------------------------------------------------------

def test_continuous_batching_matches_the_plain_forward(llm, oracle):
    core = engine(llm, max_num_seqs=3, max_num_batched_tokens=64)
    arrivals = {0: [("0", PROMPTS[0]), ("1", PROMPTS[1])], 3: [("2", PROMPTS[2])], 5: [("3", PROMPTS[3])],
                9: [("4", PROMPTS[4])]}
    got = run(core, arrivals)
    for i in range(len(PROMPTS)):
        assert got[str(i)] == (oracle[i], "length"), i
    s = core.stats()
    assert s.num_running == s.num_waiting == 0 and s.kv_blocks_used == 0


def test_a_late_request_starts_before_earlier_ones_end(llm):
    core = engine(llm)
    core.add_request("early", PROMPTS[0], quill.SamplingParams(max_tokens=30, **GREEDY))
    for _ in range(3):
        core.step()
    core.add_request("late", PROMPTS[2], quill.SamplingParams(max_tokens=5, **GREEDY))
    seen_late = False
    while core.has_unfinished_requests():
        ids = {o.request_id: o for o in core.step()}
        if "late" in ids:
            seen_late = True
        if "early" in ids and ids["early"].finish_reason:
            break
    assert seen_late  # the late request produced tokens while the early one was still decoding


def test_chunked_prefill_gives_the_same_tokens(llm, oracle):
    core = engine(llm, max_num_batched_tokens=8)  # the 37-token prompt takes five steps
    got = run(core, {0: [("1", PROMPTS[1]), ("0", PROMPTS[0])]})
    assert got["1"][0] == oracle[1] and got["0"][0] == oracle[0]


def test_preemption_recomputes_the_same_tokens(llm, oracle):
    args = llm.model.args
    per_block = 2 * args.num_hidden_layers * 4 * args.num_key_value_heads * args.head_dim * 4
    core = engine(llm, block_size=4, kv_cache_memory=14 * per_block, enable_prefix_caching=False)
    got = run(core, {0: [(str(i), p) for i, p in enumerate(PROMPTS) if i != 1]})
    assert core.stats().num_preemptions > 0
    for i in (0, 2, 3, 4):
        assert got[str(i)] == (oracle[i], "length"), i
    assert core.stats().kv_blocks_used == 0


def test_prefix_cache_hits_and_same_tokens(llm, oracle):
    core = engine(llm, block_size=4)
    run(core, {0: [("a", PROMPTS[1])]})
    core.add_request("b", PROMPTS[1], quill.SamplingParams(max_tokens=12, **GREEDY))
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    assert outs[0].num_cached_tokens == 36 and outs[0].num_prompt_tokens == 37
    assert [o.new_token_ids[0] for o in outs] == oracle[1]
    s = core.stats()
    assert s.prefix_cache_hit_tokens == 36 and s.kv_blocks_used == 0 and s.kv_blocks_cached_free > 0


def test_abort_frees_blocks_at_once(llm):
    core = engine(llm, block_size=4, enable_prefix_caching=False)
    core.add_request("x", PROMPTS[1], quill.SamplingParams(max_tokens=50, **GREEDY))
    core.add_request("y", PROMPTS[0], quill.SamplingParams(max_tokens=50, **GREEDY))
    core.step()
    core.step()
    assert core.stats().kv_blocks_used > 0
    core.abort_request("x")
    core.abort_request("nosuch")  # ignored
    assert all(o.request_id != "x" for o in core.step())
    core.abort_request("y")
    s = core.stats()
    assert s.kv_blocks_used == 0 and s.num_running == 0 and not core.has_unfinished_requests()


def test_min_tokens_masks_eos(llm):
    core = engine(llm)
    first = plain_greedy(llm.model, PROMPTS[0], 1)[0]
    core.eos = frozenset({first})  # the greedy first token is EOS now
    core.add_request("plain", PROMPTS[0], quill.SamplingParams(max_tokens=8, temperature=0))
    core.add_request("min", PROMPTS[0], quill.SamplingParams(max_tokens=8, min_tokens=4, temperature=0))
    got = run(core, {}, 8)
    assert got["plain"] == ([first], "stop")
    assert len(got["min"][0]) >= 4 and first not in got["min"][0][:4]


def test_bad_requests_are_named(llm):
    core = engine(llm)
    with pytest.raises(GenerationError, match="request a is empty"):
        core.add_request("a", [], quill.SamplingParams())
    with pytest.raises(GenerationError, match="token id 5000 is outside the vocabulary"):
        core.add_request("a", [1, 5000], quill.SamplingParams())
    with pytest.raises(GenerationError, match="longer than the context window"):
        core.add_request("a", [1] * (llm.context_length + 1), quill.SamplingParams())
    core.add_request("a", [1, 2], quill.SamplingParams())
    with pytest.raises(GenerationError, match="'a' is already in use"):
        core.add_request("a", [1, 2], quill.SamplingParams())
    with pytest.raises(GenerationError, match="EngineConfig.max_num_seqs"):
        EngineConfig(max_num_seqs=0)


def test_llm_generate_is_the_engine(llm, oracle):
    outs = llm.generate(PROMPTS, quill.SamplingParams(max_tokens=12, **GREEDY))
    assert [o.token_ids for o in outs] == [oracle[i] for i in range(len(PROMPTS))]
    assert llm.engine.stats().kv_blocks_used == 0


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def test_kv_pool_is_zero_and_takes_memory_only_where_written():
    from quill.engine.kv_cache import untouched_zeros
    before = _rss_mb()
    pool = untouched_zeros((1 << 28,), torch.float32)  # 1 GiB
    assert _rss_mb() - before < 64  # nothing resident yet (torch.zeros would make all of it so)
    assert pool.shape == (1 << 28,) and pool.dtype == torch.float32
    assert not pool[:: 1 << 16].any() and not pool[-4096:].any()  # zeros wherever read
    pool[: 1 << 20] = 1.0  # 4 MiB written: resident
    assert pool[: 1 << 20].sum().item() == float(1 << 20)
    b16 = untouched_zeros((4, 3, 2), torch.bfloat16)
    assert b16.dtype == torch.bfloat16 and not b16.any() and untouched_zeros((0, 3), torch.float32).numel() == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 70), st.sampled_from([1, 1, 1, 3, 17])), min_size=1, max_size=9),
       st.sampled_from([1, 4, 16]), st.randoms(use_true_random=False))
def test_step_layout_slots_by_their_definition(seqs, block_size, rnd):
    """Every token's slot is table[p // block_size] * block_size + p % block_size, in packed order; a
    piece's prompt tokens (p < its prompt length) are one prefill chunk, each generated token a decode
    row seeing positions 0 .. p, whatever the piece's size (a one-token prompt chunk, a recompute)."""
    from quill.engine.kv_cache import StepLayout
    pieces = []
    for done, new in seqs:
        need = -(-(done + new) // block_size)
        prompt = rnd.choice([done, done + 1, done + new, done + new + 5, max(1, done - 3)])
        pieces.append((rnd.sample(range(500), need + rnd.randint(0, 2)), done, new, prompt))  # tables may run ahead
    lay = StepLayout.build(pieces, block_size)

    def slot(table, p):
        return table[p // block_size] * block_size + p % block_size

    want = [slot(t, p) for t, done, new, _ in pieces for p in range(done, done + new)]
    assert lay.slots.tolist() == want
    starts = [sum(pc[2] for pc in pieces[:i]) for i in range(len(pieces))]
    decode = [(starts[i] + p - d, t, p) for i, (t, d, n, pr) in enumerate(pieces) for p in range(max(d, pr), d + n)]
    assert lay.decode_rows.tolist() == [r for r, _, _ in decode]
    assert lay.decode_lens.tolist() == [p + 1 for _, _, p in decode]
    width = max((p + 1 for _, _, p in decode), default=0)
    assert lay.decode_slots.shape == (len(decode), width)
    for r, (_, t, p) in enumerate(decode):
        assert lay.decode_slots[r].tolist() == [slot(t, q) for q in range(p + 1)] + [0] * (width - p - 1)
    prefill = [(starts[i], min(d + n, pr) - d, t, d) for i, (t, d, n, pr) in enumerate(pieces) if pr > d]
    assert [(s, n) for s, n, _ in lay.prefills] == [(s, n) for s, n, _, _ in prefill]
    for (_, _, ctx), (_, n, t, d) in zip(lay.prefills, prefill):
        assert ctx.tolist() == [slot(t, p) for p in range(d + n)]
    assert lay.one_row_per_sequence(len(pieces)) == all(n == 1 and d >= pr for _, d, n, pr in pieces)


# ---- faults stay with their request ------------------------------------------------------------

def test_token_ids_of_params_are_checked_before_anything_runs(llm):
    core = engine(llm)
    vocab = llm.model.args.vocab_size
    bad = quill.SamplingParams(stop_token_ids=[vocab], min_tokens=1)  # indexed the logits: an IndexError
    with pytest.raises(GenerationError, match=rf"SamplingParams.stop_token_ids: token id {vocab} is outside"):
        core.add_request("a", [1, 2], bad)
    assert not core.has_unfinished_requests()
    with pytest.raises(GenerationError, match="SamplingParams.stop_token_ids"):
        llm.generate(PROMPTS[:2], [quill.SamplingParams(max_tokens=4), bad])
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats().kv_blocks_used == 0


def test_a_temperature_below_the_greedy_threshold_is_greedy(llm, oracle):
    out = llm.generate(PROMPTS[0], quill.SamplingParams(max_tokens=12, temperature=1e-40, ignore_eos=True))[0]
    assert out.token_ids == oracle[0]


def _failing_for(params):
    """process_logits that raises for requests with exactly these ``params`` (one request's own fault)."""
    real = core_module.process_logits

    def process(logits, p, *args):
        if p is params:
            raise RuntimeError("injected sampling fault")
        return real(logits, p, *args)
    return process


def test_a_request_that_fails_in_the_step_fails_alone(llm, oracle, monkeypatch):
    bad = quill.SamplingParams(max_tokens=12, **GREEDY)
    good = quill.SamplingParams(max_tokens=12, **GREEDY)
    monkeypatch.setattr("quill.engine.core.process_logits", _failing_for(bad))
    failed_before = llm.engine.stats().num_failed
    outs = llm.generate(PROMPTS[:3], [good, bad, good])
    assert outs[1].finish_reason == "error" and outs[1].outputs[0].error == "RuntimeError: injected sampling fault"
    assert outs[1].token_ids == []
    assert [outs[0].token_ids, outs[2].token_ids] == [oracle[0], oracle[2]]
    s = llm.engine.stats()
    assert s.kv_blocks_used == 0 and s.num_failed == failed_before + 1
    with pytest.raises(RequestFailed, match="injected sampling fault"):
        list(llm.stream(PROMPTS[1], bad))


def test_a_forward_that_fails_with_one_request_fails_it_alone(llm, oracle, monkeypatch):
    """The batch's forward raises while the bad request is in it: each request runs alone once, the bad
    one fails, the others get their tokens; a forward that fails for every request is the engine's fault."""
    core = llm.engine
    bad = quill.SamplingParams(max_tokens=12, **GREEDY)
    good = quill.SamplingParams(max_tokens=12, **GREEDY)
    real = core._forward

    def forward(batch, scored):
        if any(seq.params is bad for seq, _ in batch):
            raise RuntimeError("injected forward fault")
        return real(batch, scored)

    monkeypatch.setattr(core, "_forward", forward)
    outs = llm.generate(PROMPTS[:3], [good, bad, good])
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert [outs[0].token_ids, outs[2].token_ids] == [oracle[0], oracle[2]]
    assert core.stats().kv_blocks_used == 0

    def broken(batch, scored):
        raise RuntimeError("the model is broken")

    monkeypatch.setattr(core, "_forward", broken)
    with pytest.raises(RuntimeError, match="the model is broken"):
        llm.generate(PROMPTS[:2], good)
    monkeypatch.setattr(core, "_forward", real)
    assert core.stats().kv_blocks_used == 0 and not core.has_unfinished_requests()
    assert llm.generate(PROMPTS[0], good)[0].token_ids == oracle[0]  # it serves again
