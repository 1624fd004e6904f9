"""Per-layer sliding windows (issue 38): a local layer attends its last W positions (its own included, as
transformers counts), in every attention path -- cache-less torch, the paged prefill and decode kernels
(native and torch), the native decode step -- and the context is no longer capped at the window.

Tiny random transformers models with a window of 16 on prompts of ~100 tokens: a Mistral (every layer
local) and a Qwen2 with ``use_sliding_window`` (one global and one local layer)."""

from __future__ import annotations

import pytest
import torch

import quill
from quill import native
from quill.kernels import fused
from quill.platform import detect
from tests.engine_util import engine_core as core
from tests.engine_util import greedy, hf_logprobs, scored
from tests.model_util import hf_model, save_hf_dir

WINDOW = 16
# odd sizes: hidden 72 over 6 heads of 12, 2 KV heads; 3 layers
SHAPE = dict(hidden_size=72, intermediate_size=100, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
             max_position_embeddings=256)
CONFIGS = {
    "mistral": dict(sliding_window=WINDOW),
    # layer 0 global, layers 1 and 2 local (transformers: layers from max_window_layers on)
    "qwen2": dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1),
}
PROMPT = [int(t) for t in torch.randint(4, 320, (100,), generator=torch.Generator().manual_seed(7))]
NATIVE = native.load().module is not None
ISA = native.isa_for(detect()) if NATIVE else None


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(transformers model, quill LLM on its checkpoint with a float32 cache)."""
    hf = hf_model(request.param, seed=3, **SHAPE, **CONFIGS[request.param])
    with torch.no_grad():  # bfloat16 values held in float32: what the native dense kernels (so the native step) take
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    d = save_hf_dir(hf, tmp_path_factory.mktemp(request.param), tokenizer=False)
    return hf, quill.LLM(str(d), skip_tokenizer_init=True, kv_cache_dtype="float32")


def test_layers_describe_their_windows(pair):
    hf, llm = pair
    types = getattr(hf.config, "layer_types", None) or ["sliding_attention"] * SHAPE["num_hidden_layers"]  # Mistral
    want = [hf.config.sliding_window if t == "sliding_attention" else None for t in types]
    assert [s.attention.window for s in llm.model.decoder_layer_specs()] == want
    assert WINDOW in want and llm.context_length == SHAPE["max_position_embeddings"]  # no cap at the window


@pytest.mark.parametrize("chunk", [256, 24])  # the whole prompt in one step; chunks of 24 over a cached prefix
def test_logprobs_match_transformers_at_every_position(pair, chunk):
    hf, llm = pair
    got = scored(llm, PROMPT, chunk, block_size=8)
    ref = hf_logprobs(hf, PROMPT)
    assert got.shape == ref.shape
    assert (got - ref).abs().max() < 1e-3


def test_greedy_tokens_match_transformers(pair):
    hf, llm = pair
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, min_new_tokens=32)
    want = ref[0, len(PROMPT):].tolist()
    for native_step in ([True, False] if NATIVE else [False]):
        c = core(llm, native_step=native_step, block_size=8)
        assert (c.native_step is not None) == native_step, c.native_step_reason
        assert greedy(c, {"a": PROMPT})["a"] == want, native_step


def test_batched_preempted_equal_alone(pair):
    _, llm = pair
    prompts = {str(i): PROMPT[i * 7:] for i in range(3)}  # 100, 93, 86 tokens: windows end at different places
    alone = {rid: greedy(core(llm, block_size=8), {rid: p}, 24)[rid] for rid, p in prompts.items()}
    assert greedy(core(llm, block_size=8), prompts, 24) == alone
    args = llm.model.args
    per_block = 2 * args.num_hidden_layers * 8 * args.num_key_value_heads * args.head_dim * 4
    tight = core(llm, block_size=8, kv_cache_memory=30 * per_block, enable_prefix_caching=False)
    assert greedy(tight, prompts, 24) == alone
    assert tight.stats().num_preemptions > 0


@pytest.mark.skipif(not NATIVE, reason="native kernels not built")
def test_native_paged_kernels_match_torch_with_a_window():
    g = torch.Generator().manual_seed(0)
    pool_k, pool_v = (torch.randn(64, 2, 12, generator=g) for _ in range(2))
    perm = torch.randperm(64, generator=g)
    # decode: three sequences of 40, 9 and 17 positions (shorter than the window: every position)
    lens = torch.tensor([40, 9, 17])
    slots = torch.stack([perm[:40], perm[10:50], perm[20:60]])
    q = torch.randn(3, 6, 1, 12, generator=g)
    for w in (WINDOW, 1, None):
        got = fused.paged_decode_attention(q, pool_k, pool_v, slots, lens, 0.3, ISA, w)
        ref = fused.paged_decode_attention(q, pool_k, pool_v, slots, lens, 0.3, None, w)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # prefill: 70 new tokens after 30 cached (query blocks straddle the window's start)
    ctx = torch.cat([perm, perm[:36]])
    qp = torch.randn(70, 6, 12, generator=g)
    for w in (WINDOW, 1, 100, None):
        got = fused.paged_prefill_attention(qp, pool_k, pool_v, ctx[:100], 0.3, ISA, w)
        ref = fused.paged_prefill_attention(qp, pool_k, pool_v, ctx[:100], 0.3, None, w)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
