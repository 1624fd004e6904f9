"""quill eval: strided-window perplexity against transformers, KL against a base, bad input."""

import json
import math

import pytest
import torch

import quill
from quill.cli import main
from quill.engine.core import EngineConfig
from quill.errors import EvalError
from quill.eval.compare import BaseScores, compare, score_base, topk_kl
from quill.eval.perplexity import make_windows, perplexity
from tests.fixture_util import fixture_path
from tests.model_util import hf_model, save_hf_dir

TEXT = ("The capital of France is Paris. Hello world, what is the answer? The quick brown fox jumps over the "
        "lazy dog. ") * 12


def hf_perplexity(model, tokens: list[int], context: int, stride: int) -> float:
    """exp(mean NLL) from transformers logits over the same windows (the oracle)."""
    nll = []
    with torch.no_grad():
        for w in make_windows(len(tokens), context, stride):
            logits = model(torch.tensor([tokens[w.begin:w.end]])).logits[0].double()
            lps = torch.log_softmax(logits, -1)
            for p in range(w.first, w.end - w.begin):
                nll.append(-float(lps[p - 1, tokens[w.begin + p]]))
    return math.exp(sum(nll) / len(nll))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random float32 llama (transformers) and the same weights as an HF directory quill loads."""
    model = hf_model("llama")
    d = save_hf_dir(model, tmp_path_factory.mktemp("tiny-llama"))
    text = tmp_path_factory.mktemp("text") / "text.txt"
    text.write_text(TEXT)
    return model, d, text


@pytest.mark.parametrize("num_tokens,context,stride", [(10, 4, 4), (11, 4, 3), (100, 32, 7), (5, 64, 64)])
def test_windows_score_every_token_once_with_enough_context(num_tokens, context, stride):
    windows = make_windows(num_tokens, context, stride)
    scored = [w.begin + p for w in windows for p in range(w.first, w.end - w.begin)]
    if stride < context:
        assert scored == list(range(1, num_tokens))
    else:  # disjoint windows: a window's first token has nothing before it to be predicted from
        assert scored == [t for t in range(1, num_tokens) if t % context]
    for w in windows:
        assert w.end - w.begin <= context
        assert w.first >= 1 and (w.begin == 0 or w.first >= context - stride)


def test_perplexity_matches_transformers_on_the_same_windows(tiny, capsys):
    model, d, text = tiny
    llm = quill.LLM(str(d), kv_cache_dtype="float32")  # transformers' float cache
    tokens = llm.tokenizer.encode(TEXT)
    assert len(tokens) > 200
    for context, stride in [(64, 24), (48, 48), (128, 100)]:
        ours = perplexity(llm, tokens, context, stride)
        ref = hf_perplexity(model, tokens, context, stride)
        assert abs(ours.perplexity / ref - 1) <= 1e-4, (context, stride, ours.perplexity, ref)
        assert ours.tokens_evaluated == len(tokens) - (1 if stride < context else ours.windows)
    assert main(["eval", "perplexity", str(d), "--text", str(text), "--context", "64", "--stride", "24",
                 "--kv-cache-dtype", "float32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert abs(out["perplexity"] / hf_perplexity(model, tokens, 64, 24) - 1) <= 1e-4
    assert out["tokens_evaluated"] == len(tokens) - 1 and out["perplexity_stderr"] > 0


@pytest.mark.parametrize("kernel", ["reference", None])
def test_perplexity_of_a_real_tool_fixture_matches_its_transformers_twin(kernel):
    from tests.test_fixture_models import transformers_twin
    name = "ct-w4a16-sym-g128-llama"
    twin = transformers_twin(name)
    llm = quill.LLM(str(fixture_path(name)), skip_tokenizer_init=True, kernel=kernel, kv_cache_dtype="float32")
    tokens = torch.randint(0, twin.config.vocab_size, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = perplexity(llm, tokens, 96, 40).perplexity
    ref = hf_perplexity(twin, tokens, 96, 40)
    assert abs(ours / ref - 1) <= (1e-4 if kernel == "reference" else 1e-2), (ours, ref)


def test_kl_of_a_model_against_itself_is_zero(tiny):
    _, d, _ = tiny
    llm = quill.LLM(str(d))
    tokens = llm.tokenizer.encode(TEXT)
    base = score_base(llm, tokens, 64, 24, 16, "tiny")
    result = compare(base, llm, tokens, "tiny again")
    assert result.kl_mean == 0 and result.kl_max == 0 and result.top1_agreement == 1
    assert result.ppl_ratio == 1 and result.tokens_evaluated == len(tokens) - 1


def test_topk_kl_is_the_full_kl_at_full_k_and_a_lower_bound_below():
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(50, 40, generator=g) * 2, -1)
    lq = torch.log_softmax(torch.randn(50, 40, generator=g) * 2, -1)
    full = (lp.exp() * (lp - lq)).sum(-1).double()
    assert torch.allclose(topk_kl(lp, lq), full, atol=1e-6)
    top = torch.topk(lp, 5, -1).indices
    part = topk_kl(lp.gather(1, top), lq.gather(1, top))
    assert bool((part <= full + 1e-6).all()) and bool((part > 0).all())


def test_compare_int8_activations_against_a_saved_base(tmp_path):
    name = "ct-w4a16-sym-g128-llama"
    from tests.test_fixture_models import transformers_twin
    vocab = transformers_twin(name).config.vocab_size
    # the fixtures carry no tokenizer: scored through the API on token ids, the base saved and read back
    llm = quill.LLM(str(fixture_path(name)), skip_tokenizer_init=True)
    tokens = torch.randint(0, vocab, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    base = score_base(llm, tokens, 64, 32, 8, name)
    saved = tmp_path / "base.safetensors"
    base.save(saved)
    again = BaseScores.load(saved)
    assert again.tokens == tokens and torch.equal(again.top_ids, base.top_ids)
    w4a8 = quill.LLM(str(fixture_path(name)), skip_tokenizer_init=True, activation_quant="int8")
    result = compare(again, w4a8, tokens, "w4a8")
    assert 0 < result.kl_mean < 0.05 and 0.8 < result.top1_agreement < 1
    assert result.kl_median <= result.kl_p99 <= result.kl_max
    with pytest.raises(EvalError, match="tokenizer"):
        compare(again, w4a8, tokens[:-1], "w4a8")


def test_compare_cli_end_to_end(tiny, tmp_path, capsys):
    _, d, text = tiny
    saved = tmp_path / "base.safetensors"
    other = save_hf_dir(hf_model("llama", seed=5), tmp_path / "other")  # the same shapes, other weights
    assert main(["eval", "compare", str(d), str(other), "--text", str(text), "--context", "64", "--stride", "32",
                 "--save-base", str(saved), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["kl_mean"] > 0 and first["tokens_evaluated"] > 200
    assert main(["eval", "compare", str(saved), str(d), "--text", str(text), "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["kl_mean"] == 0 and same["top1_agreement"] == 1
    assert main(["eval", "compare", str(saved), str(d), "--text", str(text), "--context", "32"]) == 2
    assert "--context 64" in capsys.readouterr().err


def test_bad_input_gets_a_clear_error(tiny, tmp_path, capsys):
    _, d, text = tiny
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    cases = [
        (["--text", str(empty)], "empty"),
        (["--text", str(text), "--context", "4096"], "larger than the model's context window of 128"),
        (["--text", str(text), "--context", "64", "--stride", "0"], "--stride must be in"),
        (["--text", str(text), "--context", "64", "--stride", "65"], "--stride must be in"),
        (["--text", str(tmp_path / "missing.txt")], "cannot read"),
        (["--text", str(text), "--max-tokens", "1"], "--max-tokens must be at least 2"),
    ]
    for extra, message in cases:
        assert main(["eval", "perplexity", str(d), *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra
    not_base = tmp_path / "x.safetensors"
    from safetensors.torch import save_file
    save_file({"a": torch.zeros(2)}, str(not_base))
    assert main(["eval", "compare", str(not_base), str(d), "--text", str(text)]) == 2
    assert "not a quill base-scores file" in capsys.readouterr().err


def test_scores_survive_preemption_and_prefix_cache_hits(tiny):
    """A scored prompt preempted mid-prefill, or sharing cached blocks, scores every token it asked for."""
    from quill.engine.kv_cache import PagedKVCache
    from quill.engine.scoring import ScoreSpec
    _, d, _ = tiny
    # a float32 cache: the pool sizes below count float32 blocks, and scores must not depend on chunking
    roomy = quill.LLM(str(d), kv_cache_dtype="float32")
    tokens = roomy.tokenizer.encode(TEXT)[:120]
    want = roomy.score([tokens], ScoreSpec(first=1, top_k=3))[0]
    # 8 blocks of 16 tokens, chunks of 32: a 30-token request decoding needs its third block while
    # the scored 90-token prompt (6 blocks) is mid-prefill, which preempts the scored one
    per_block = PagedKVCache.bytes_per_block(2, 16, 2, 16, torch.float32)
    tight = quill.LLM(str(d), kv_cache_dtype="float32", engine_config=EngineConfig(
        max_num_batched_tokens=32, block_size=16, kv_cache_memory=8 * per_block))
    assert tight.engine.blocks.num_blocks == 8
    tight.processor.add("decoder", None, tokens[30:60], quill.SamplingParams(max_tokens=60, ignore_eos=True))
    got = tight.score([tokens[:90]], ScoreSpec(first=1, top_k=3))[0]
    assert tight.engine.scheduler.num_preemptions > 0
    assert torch.allclose(got.token_logprobs, want.token_logprobs[:89], atol=1e-5)
    assert torch.equal(got.top_ids, want.top_ids[:89])
    # prompt_logprobs rebuild from position 0 after a preemption
    tight.processor.add("decoder-2", None, tokens[30:60], quill.SamplingParams(max_tokens=60, ignore_eos=True))
    preempted = tight.engine.scheduler.num_preemptions
    out = tight.generate([{"prompt_token_ids": tokens[:90]}], quill.SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert tight.engine.scheduler.num_preemptions > preempted
    lps = out[0].prompt_logprobs
    assert len(lps) == 90 and lps[0] is None
    got = torch.tensor([lps[i][tokens[i]].logprob for i in range(1, 90)])
    assert torch.allclose(got, want.token_logprobs[:89], atol=1e-5)
    # a prompt whose first blocks are cached: only positions before the first scored token are reused
    roomy.generate([{"prompt_token_ids": tokens[:80]}], quill.SamplingParams(max_tokens=1))
    hits = roomy.engine.stats().prefix_cache_hit_tokens
    part = roomy.score([tokens], ScoreSpec(first=60))[0]
    assert roomy.engine.stats().prefix_cache_hit_tokens - hits == 48  # 3 blocks: positions 0..47 < 59
    assert torch.allclose(part.token_logprobs, want.token_logprobs[59:], atol=1e-5)


def test_a_dataset_that_cannot_be_loaded_is_named_before_any_model_loads(tmp_path):
    import os
    import subprocess
    import sys
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    missing = tmp_path / "no-such-model"  # never reached: the text is read first
    r = subprocess.run([sys.executable, "-m", "quill", "eval", "perplexity", str(missing), "--dataset", "foo/bar"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "--dataset foo/bar: cannot load it" in r.stderr, r.stderr


def test_a_saved_base_alone_needs_an_other_model(tmp_path, capsys):
    assert main(["eval", "compare", str(tmp_path / "base.safetensors"), "--pydoc-topics"]) == 2
    assert "name the OTHER model" in capsys.readouterr().err
