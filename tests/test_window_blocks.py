"""The sliding-window layers' own block group (quill/engine/window_blocks.py, issue 38): a sequence's local
layers hold only the blocks their window reads (checked exactly after every step of a prompt six windows
long and its 32 greedy tokens, transformers' own), blocks go back on finish, abort and preemption,
preempted = uninterrupted and batched = alone with the group sized to its bound, and a prefix-cache hit
(reused only as far as the window's blocks are still held) gives the tokens of a miss.  Tiny random
Gemma 3 and gpt-oss models (tests/test_gemma3.py, tests/test_gpt_oss.py, whose engines free local blocks
too: there the log-probabilities at every position are checked against transformers), window 16, blocks
of 8."""

from __future__ import annotations

import pytest
import torch

import quill
from quill.engine.block_manager import BlockManager
from quill.engine.sampling import SamplingParams
from quill.engine.sequence import Sequence, Status
from quill.engine.window_blocks import NULL, WindowBlocks, window_blocks_needed
from quill.errors import KernelError
from tests.engine_util import engine_core, greedy
from tests.model_util import save_hf_dir
from tests.test_gemma3 import hf_gemma3
from tests.test_gpt_oss import hf_gpt_oss

WINDOW, BS = 16, 8
PROMPT = [int(t) for t in torch.randint(4, 320, (100,), generator=torch.Generator().manual_seed(5))]
MODELS = {"gemma3": (hf_gemma3, [0, 2]), "gpt_oss": (hf_gpt_oss, [0, 2])}  # builder, its local layers


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request, tmp_path_factory):
    build, local = MODELS[request.param]
    hf = build(seed=1)
    d = save_hf_dir(hf, tmp_path_factory.mktemp(request.param), tokenizer=False)
    return hf, quill.LLM(str(d), skip_tokenizer_init=True, kv_cache_dtype="float32"), local


def held_by_window(num_computed: int) -> int:
    """Local blocks a sequence holds once ``num_computed`` positions are computed: from the block the next
    query's window starts in to the last computed one."""
    return -(-num_computed // BS) - max(0, num_computed - WINDOW + 1) // BS


def test_local_blocks_follow_the_window_exactly(pair):
    hf, llm, local = pair
    assert llm.engine.blocks.window is not None  # a default engine frees local blocks too (the model tests')
    c = engine_core(llm, block_size=BS, max_num_batched_tokens=24, max_num_seqs=4)
    w = c.blocks.window
    cap = window_blocks_needed(WINDOW, BS, 4, 24)
    assert (w.num_blocks, w.window, c.cache.local_layers) == (cap, WINDOW, frozenset(local))
    rows = [k.shape[0] for k in c.cache.keys]  # the local layers' pools: the group's blocks and the null block
    assert [r // BS for i, r in enumerate(rows) if i in local] == [cap + 1] * len(local)
    assert all(r == c.blocks.num_blocks * BS for i, r in enumerate(rows) if i not in local)
    c.add_request("a", PROMPT, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    seq, tokens, most = c.requests["a"], [], 0
    while c.has_unfinished_requests():
        for o in c.step():
            tokens += o.new_token_ids
        if seq.status is Status.RUNNING:
            held = WindowBlocks.held(seq)
            assert held == held_by_window(seq.num_computed), seq.num_computed
            assert len(seq.block_table) >= -(-seq.num_computed // BS)  # the global layers keep every position
            assert c.stats().kv_local_blocks_used == held
            assert all(b == NULL for b in seq.window_table[:seq.window_freed])
            most = max(most, held)
    assert most == (WINDOW - 2) // BS + 2 == 3  # against 17 blocks of the 132 positions
    s = c.stats()
    assert (s.kv_local_blocks_used, s.kv_blocks_used, s.kv_local_blocks_total) == (0, 0, cap)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, min_new_tokens=32)
    assert tokens == ref[0, len(PROMPT):].tolist()


def test_blocks_come_back_on_abort_and_preemption(pair):
    """A global group too small for three sequences preempts; the local group, sized to its bound, never runs
    out; preempted and batched runs give each request's tokens alone; every block comes back."""
    _, llm, local = pair
    cfg = dict(block_size=BS, max_num_batched_tokens=24, max_num_seqs=3, enable_prefix_caching=False)
    args = llm.model.args
    per_block = 2 * BS * args.num_key_value_heads * args.head_dim * 4  # one layer's k and v, float32
    cap = window_blocks_needed(WINDOW, BS, 3, 24)
    n_global = args.num_hidden_layers - len(local)
    budget = 30 * n_global * per_block + (cap + 1) * len(local) * per_block  # 30 global blocks, 48 wanted
    prompts = {str(i): PROMPT[i * 7:] for i in range(3)}
    alone = {rid: greedy(engine_core(llm, **cfg), {rid: p}, 24)[rid] for rid, p in prompts.items()}
    c = engine_core(llm, kv_cache_memory=budget, **cfg)
    assert (c.blocks.num_blocks, c.blocks.window.num_blocks) == (30, cap)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for rid, p in prompts.items():
        c.add_request(rid, p, params)
    out = {rid: [] for rid in prompts}
    while c.has_unfinished_requests():
        for o in c.step():
            out[o.request_id] += o.new_token_ids
        live = [s for s in c.requests.values() if s.status is Status.RUNNING]
        assert c.blocks.window.num_used == sum(WindowBlocks.held(s) for s in live)
        assert all(not s.window_table for s in c.scheduler.waiting)  # preempted: all given back
    assert out == alone and c.stats().num_preemptions > 0
    assert c.blocks.window.num_used == 0 and c.blocks.num_used == 0
    c.add_request("x", PROMPT, params)
    for _ in range(6):
        c.step()
    assert c.blocks.window.num_used > 0
    c.abort_request("x")
    assert c.blocks.window.num_used == 0 and c.blocks.num_used == 0


def run(c, prompt: list[int]) -> tuple[list[int], list[float], int]:
    """(16 greedy tokens, their log-probabilities, prompt tokens taken from the prefix cache)."""
    c.add_request("r", prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0))
    tokens, lps, cached = [], [], 0
    while c.has_unfinished_requests():
        for o in c.step():
            tokens += o.new_token_ids
            lps += [d[t].logprob for d, t in zip(o.logprobs, o.new_token_ids)]
            cached = o.num_cached_tokens
    return tokens, lps, cached


def test_prefix_cache_hit_gives_the_bits_of_a_miss(pair):
    _, llm, _ = pair
    c = engine_core(llm, block_size=BS, max_num_batched_tokens=24)
    run(c, PROMPT)
    other = PROMPT[:90] + [7, 8, 9, 10, 11]
    hit = run(c, other)
    assert hit[2] == 88  # 11 blocks, far past the window: their local twins were still held
    miss = run(engine_core(llm, block_size=BS, max_num_batched_tokens=24, enable_prefix_caching=False), other)
    # the same tokens; log-probabilities to a few ulps (the prompt's last chunk is 7 rows here, 23 there: the
    # linear kernels' bits depend on the rows of a call, without the local group too)
    assert hit[0] == miss[0] and miss[2] == 0
    assert max(abs(a - b) for a, b in zip(hit[1], miss[1])) < 1e-5


def test_the_load_line_states_both_groups(pair):
    _, llm, _ = pair
    w = llm.engine.blocks.window
    assert llm.arithmetic["KV blocks"] == (f"{llm.engine.blocks.num_blocks} for the global layers, {w.num_blocks} "
                                           f"for the sliding-window layers (window {WINDOW}: blocks out of it are "
                                           "freed)")


def test_the_native_step_reads_the_local_tables(pair):
    """The local layers' pools are smaller than the global ones: the native step refuses to run them through the
    global tables, and checks the local ones against their own pool."""
    _, llm, local = pair
    step = llm.engine.native_step
    if step is None:
        pytest.skip(f"no native decode step: {llm.engine.native_step_reason}")
    rope = [torch.zeros(1, 1, llm.model.args.head_dim)] * len(step.tables)
    h, one = torch.zeros(1, llm.model.args.hidden_size), torch.ones(1, dtype=torch.int64)
    slots, ctx = torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(KernelError, match="forward needs 'local_slots' and 'local_ctx_slots'"):
        step.handle.forward(h, rope, rope, slots, ctx, one, True)
    rows = llm.engine.cache.keys[local[0]].shape[0]
    with pytest.raises(KernelError, match=f"token 0 writes pool row {rows}; the pool has {rows} \\(local_slots"):
        step.handle.forward(h, rope, rope, slots, ctx, one, True, local_slots=slots + rows, local_ctx_slots=ctx)


def chunked(bm: BlockManager, seq: Sequence, n: int) -> None:
    """What the engine does for ``seq`` each step, ``n`` positions at a time, up to its tokens."""
    while seq.num_computed < seq.num_tokens:
        k = min(n, seq.num_tokens - seq.num_computed)
        bm.cover_window(seq, k)
        seq.num_computed += k
        bm.register_computed(seq)


def test_a_cached_prefix_is_reused_only_as_far_as_its_window_is_held():
    """Blocks of 4, window 6 (a query reads its block and the one before), 8 local blocks: a hit needs the local
    twins of the blocks its first query's window reads, no others; evicting them shortens the hit."""
    gen = torch.Generator()
    bm = BlockManager(64, 4, True, None, WindowBlocks(8, 4, 6))
    a = Sequence("a", list(range(40)), SamplingParams(max_tokens=1), gen, 0)
    bm.allocate(a)
    chunked(bm, a, 8)
    assert WindowBlocks.held(a) == 10 - 35 // 4  # blocks 8 and 9
    bm.free_blocks(a)
    assert bm.window.num_used == 0 and bm.window.num_cached_free > 0
    b = Sequence("b", list(range(40)) + [99], SamplingParams(max_tokens=1), gen, 1)
    assert len(bm.cached_prefix(b)) == 10  # twins of blocks 8, 9 still cached (0 .. 7 evicted: no matter)
    bm.allocate(b)
    assert b.window_table[:8] == [NULL] * 8 and NULL not in b.window_table[8:] and b.num_computed == 40
    bm.free_blocks(b)
    c = Sequence("c", list(range(100, 140)), SamplingParams(max_tokens=1), gen, 2)
    bm.allocate(c)
    chunked(bm, c, 24)  # takes every local block: a's twins are evicted
    bm.free_blocks(c)
    assert len(bm.cached_prefix(b)) == 0 and bm.window.num_cached_free == len(bm.window.twin)
