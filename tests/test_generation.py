"""Generation: greedy against transformers, sampling controls, stops, logprobs, prompts, errors."""

import pytest
import torch

import quill
from quill.engine.sampling import apply_repetition_penalty, filter_logits
from quill.errors import CheckpointError, GenerationError, ModelError
from tests.model_util import hf_model, save_hf_dir

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = hf_model("llama", seed=21)
    d = save_hf_dir(hf, tmp_path_factory.mktemp("tiny") / "llama")
    return hf, quill.LLM(str(d), kernel="reference", kv_cache_dtype="float32")  # transformers' float cache


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_batch_matches_transformers(tiny):
    hf, llm = tiny
    prompts = [[5, 17, 99, 42], [8, 9, 10, 11, 12, 13, 200, 201, 7]]
    outs = llm.generate(prompts, quill.SamplingParams(max_tokens=12, **GREEDY))
    for p, o in zip(prompts, outs):
        assert o.prompt_token_ids == p
        assert o.token_ids == hf_greedy(hf, p, 12)
        assert o.finish_reason == "length" and len(o.token_ids) == 12
        assert o.timings.generated_tokens == 12 and o.timings.prompt_tokens == len(p)
        assert o.timings.prefill_s > 0 and o.timings.decode_s > 0
    # alone or in a batch, a prompt gets the same tokens
    assert llm.generate(prompts[1], quill.SamplingParams(max_tokens=12, **GREEDY))[0].token_ids == outs[1].token_ids


def test_seed_reproducible(tiny):
    _, llm = tiny
    sp = quill.SamplingParams(temperature=1.0, max_tokens=20, seed=1234, ignore_eos=True)
    a = llm.generate([[5, 6, 7]], sp)[0].token_ids
    b = llm.generate([[5, 6, 7]], sp)[0].token_ids
    c = llm.generate([[5, 6, 7]], quill.SamplingParams(temperature=1.0, max_tokens=20, seed=99, ignore_eos=True))
    assert a == b and a != c[0].token_ids


def test_filters_mask_the_right_tokens():
    logits = torch.log(torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]))
    kept = lambda out: sorted(torch.nonzero(out > float("-inf")).flatten().tolist())  # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == [1, 3]
    assert kept(filter_logits(logits, top_p=0.69)) == [1, 3]  # 0.4 + 0.3 reaches 0.69
    assert kept(filter_logits(logits, top_p=0.71)) == [1, 3, 4]
    assert kept(filter_logits(logits, top_p=0.01)) == [1]  # at least one token survives
    assert kept(filter_logits(logits, top_p=5e-324)) == [1]  # below float32's range: still the top token
    assert kept(filter_logits(logits, min_p=0.2)) == [1, 2, 3, 4]  # drops p < 0.08
    assert kept(filter_logits(logits, min_p=0.5)) == [1, 3]
    assert kept(filter_logits(logits, top_k=3, top_p=0.9, min_p=0.3)) == [1, 3, 4]
    assert kept(filter_logits(logits)) == [0, 1, 2, 3, 4]


def test_repetition_penalty():
    out = apply_repetition_penalty(torch.tensor([2.0, -2.0, 1.0]), torch.tensor([0, 1, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_sampling_respects_top_k(tiny):
    hf, llm = tiny
    prompt = [3, 30, 31]
    with torch.no_grad():
        top2 = set(hf(torch.tensor([prompt])).logits[0, -1].topk(2).indices.tolist())
    firsts = {llm.generate([prompt], quill.SamplingParams(temperature=5.0, top_k=2, max_tokens=1, seed=s))[0]
              .token_ids[0] for s in range(12)}
    assert firsts <= top2 and len(firsts) == 2


def test_stop_token_ids_and_eos(tiny):
    _, llm = tiny
    base = llm.generate([[40, 41, 42]], quill.SamplingParams(max_tokens=10, **GREEDY))[0]
    stop = base.token_ids[4]
    first = base.token_ids.index(stop)
    out = llm.generate([[40, 41, 42]], quill.SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop]))[0]
    assert out.token_ids == base.token_ids[:first + 1]  # the stop token is the last id...
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == llm.tokenizer.decode(base.token_ids[:first])  # ...but not part of the text
    saved = llm.eos_token_ids
    try:
        llm.eos_token_ids = (stop,)
        eos = llm.generate([[40, 41, 42]], quill.SamplingParams(max_tokens=10, temperature=0))[0]
        ign = llm.generate([[40, 41, 42]], quill.SamplingParams(max_tokens=10, **GREEDY))[0]
    finally:
        llm.eos_token_ids = saved
    assert eos.token_ids == out.token_ids and eos.finish_reason == "stop" and eos.outputs[0].stop_reason is None
    assert ign.token_ids == base.token_ids


def test_stop_strings_are_not_emitted(tiny):
    _, llm = tiny
    prompt = "the capital of"
    base = llm.generate(prompt, quill.SamplingParams(max_tokens=24, **GREEDY))[0]
    text = base.text
    assert len(text) > 6
    stop = text[3:6]
    cut = text.index(stop)
    sp = quill.SamplingParams(max_tokens=24, stop=["zzzz-never", stop], **GREEDY)
    out = llm.generate(prompt, sp)[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    pieces = [c.text for c in llm.stream(prompt, sp)]
    assert "".join(pieces) == text[:cut]
    assert not any(stop in p for p in pieces)


def test_max_tokens_and_text(tiny):
    _, llm = tiny
    out = llm.generate(["hello world", "the"], quill.SamplingParams(max_tokens=5, **GREEDY))
    for o in out:
        assert len(o.token_ids) == 5 and o.finish_reason == "length"
        assert o.text == llm.tokenizer.decode(o.token_ids)
    streamed = list(llm.stream("hello world", quill.SamplingParams(max_tokens=5, **GREEDY)))
    assert "".join(c.text for c in streamed) == out[0].text
    assert [c.token_id for c in streamed] == out[0].token_ids
    assert [c.finish_reason for c in streamed] == [None] * 4 + ["length"]


def test_logprobs_match_transformers(tiny):
    hf, llm = tiny
    prompt = [7, 70, 170, 270, 9]
    out = llm.generate([prompt], quill.SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=-1, **GREEDY))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + out.token_ids])).logits[0], -1)
    assert out.prompt_logprobs[0] is None
    for i, lp in enumerate(out.prompt_logprobs[1:]):
        assert len(lp) == 320
        got = torch.tensor([lp[t].logprob for t in range(320)])
        torch.testing.assert_close(got, ref[i], rtol=1e-4, atol=1e-5)
        assert lp[prompt[i + 1]].rank == int((ref[i] > ref[i][prompt[i + 1]]).sum()) + 1
    for step, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + step]
        assert tok in lp and lp[tok].rank == 1  # greedy picks the most likely
        assert set(lp) == set(row.topk(3).indices.tolist())
        for t, entry in lp.items():
            assert abs(entry.logprob - float(row[t])) < 1e-4
            assert entry.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)


def test_sampled_token_always_in_logprobs(tiny):
    _, llm = tiny
    out = llm.generate([[11, 12]], quill.SamplingParams(temperature=3.0, max_tokens=8, logprobs=1, seed=3,
                                                        ignore_eos=True))[0]
    assert all(t in lp and len(lp) <= 2 for t, lp in zip(out.token_ids, out.logprobs))
    assert any(lp[t].rank > 1 for t, lp in zip(out.token_ids, out.logprobs))  # hot sampling left the top


def test_chat_uses_the_template(tiny):
    _, llm = tiny
    msgs = [{"role": "user", "content": "hello"}]
    ids = llm.chat_prompt(msgs)
    assert llm.tokenizer.decode(ids, skip_special_tokens=False) == \
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    out = llm.chat(msgs, quill.SamplingParams(max_tokens=4, **GREEDY))
    assert out[0].prompt_token_ids == ids and len(out[0].token_ids) == 4
    assert "".join(c.text for c in llm.stream_chat(msgs, quill.SamplingParams(max_tokens=4, **GREEDY))) == out[0].text


def test_streaming_detokenizer_keeps_multibyte_characters(tiny):
    _, llm = tiny
    text = "paris é € 😀 naïve"
    ids = llm.tokenizer.encode(text)
    assert len(ids) > len(text.split())  # the multi-byte characters span several tokens
    detok = llm.tokenizer.detokenizer()
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert any(p == "" for p in pieces)  # some tokens were incomplete characters, held back


def test_prompt_longer_than_context(tiny):
    _, llm = tiny
    with pytest.raises(GenerationError, match="129 tokens, longer than the context window of 128"):
        llm.generate([[5] * 129])
    out = llm.generate([[5] * 126], quill.SamplingParams(max_tokens=50, **GREEDY))[0]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"  # stops at the window


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=2), "min_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(logprobs=-5), "logprobs"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(seed=1.5), "seed"),
    (dict(temperature=float("nan")), "temperature"), (dict(max_tokens=True), "max_tokens"),
])
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(GenerationError, match=f"SamplingParams.{field}"):
        quill.SamplingParams(**kwargs)


def test_bad_prompts(tiny):
    _, llm = tiny
    with pytest.raises(GenerationError, match="prompt 0 is empty"):
        llm.generate([[]])
    with pytest.raises(GenerationError, match="token id 999 is outside the vocabulary"):
        llm.generate([[1, 999]])
    with pytest.raises(GenerationError, match="no prompts"):
        llm.generate([])
    with pytest.raises(GenerationError, match="2 prompts but 3 SamplingParams"):
        llm.generate(["a", "b"], [quill.SamplingParams()] * 3)


def test_skip_tokenizer_init(tiny, tmp_path):
    hf, _ = tiny
    d = save_hf_dir(hf, tmp_path / "notok", tokenizer=False)
    with pytest.raises(CheckpointError, match="no tokenizer.json.*skip_tokenizer_init=True"):
        quill.LLM(str(d))
    llm = quill.LLM(str(d), skip_tokenizer_init=True, kernel="reference", kv_cache_dtype="float32")
    out = llm.generate({"prompt_token_ids": [5, 6]}, quill.SamplingParams(max_tokens=3, **GREEDY))[0]
    assert out.text == "" and out.token_ids == hf_greedy(hf, [5, 6], 3)
    with pytest.raises(GenerationError, match="text prompts need a tokenizer"):
        llm.generate("hello")
    with pytest.raises(GenerationError, match="stop strings need a tokenizer"):
        llm.generate([5], quill.SamplingParams(stop=["x"]))


def test_bad_options(tiny, tmp_path):
    _, llm = tiny
    with pytest.raises(GenerationError, match="prompt_token_ids should be a list of token ids"):
        llm.generate({"prompt_token_ids": ["a", "b"]})
    with pytest.raises(GenerationError, match="a prompt should be text, a list of token ids or a dict"):
        llm.generate([3.5])
    for kwargs, match in ((dict(dtype="float16"),
                           r"dtype 'float16' is not supported; supported: float32 \(bfloat16 is accepted and runs as"),
                          (dict(activation_quant="int4"), "activation_quant 'int4' is not supported"),
                          (dict(threads=0), "threads: expected a positive integer"),
                          (dict(max_model_len=-1), "max_model_len: expected a positive integer")):
        with pytest.raises(ModelError, match=match):
            quill.LLM(str(tmp_path), **kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(seed=2**64), "seed"), (dict(seed=-2**63 - 1), "seed"), (dict(temperature=float("inf")), "temperature"),
    (dict(repetition_penalty=1e-300), "repetition_penalty"), (dict(repetition_penalty=1e3), "repetition_penalty"),
    (dict(top_p=float("nan")), "top_p"), (dict(presence_penalty=float("-inf")), "presence_penalty"),
])
def test_sampling_params_outside_their_real_range(kwargs, field):
    """Values that once stopped the server's engine (torch refused the seed, the logits overflowed)."""
    with pytest.raises(GenerationError, match=f"SamplingParams.{field}: expected a"):
        quill.SamplingParams(**kwargs)


def test_sampling_params_at_the_ends_of_their_range(tiny):
    _, llm = tiny
    assert quill.SamplingParams(temperature=1e-40).greedy and not quill.SamplingParams(temperature=1e-5).greedy
    prompt = [5, 17, 99, 42]
    for seed in (2**64 - 1, -2**63):
        params = quill.SamplingParams(max_tokens=4, seed=seed, repetition_penalty=0.01, ignore_eos=True)
        a, b = llm.generate([prompt, prompt], params)
        assert a.token_ids == b.token_ids and len(a.token_ids) == 4


def test_a_request_whose_text_fails_ends_alone(tiny, monkeypatch):
    """Detokenizing one request raises: that request ends with "error", the others get their text."""
    from quill.engine.text import SequenceText
    _, llm = tiny
    real = SequenceText.add

    def add(self, *args, **kw):
        if "@@" in self.stops:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(self, *args, **kw)

    want = llm.generate(["hello there"], quill.SamplingParams(max_tokens=6, **GREEDY))[0]
    monkeypatch.setattr(SequenceText, "add", add)
    outs = llm.generate(["hello world", "hello there"], [quill.SamplingParams(max_tokens=6, stop=["@@"], **GREEDY),
                                                         quill.SamplingParams(max_tokens=6, **GREEDY)])
    assert outs[0].finish_reason == "error" and outs[0].outputs[0].error.startswith("UnicodeDecodeError")
    assert outs[1].text == want.text and outs[1].token_ids == want.token_ids
    assert llm.engine.stats().kv_blocks_used == 0 and not llm.engine.has_unfinished_requests()
