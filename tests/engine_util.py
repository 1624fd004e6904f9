"""Driving an EngineCore over a loaded model in tests, and transformers' log-probabilities to compare with."""

from __future__ import annotations

import torch

import quill
from quill.engine.core import EngineConfig, EngineCore
from quill.engine.scoring import ScoreSpec


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """float32 [len(ids) - 1]: log p(ids[i] | ids[:i]) from transformers' eager float32 forward."""
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def engine_core(llm, **cfg) -> EngineCore:
    """An engine over ``llm``'s model with a float32 KV cache (the exact one) and ``cfg``."""
    return EngineCore(llm.model, llm.eos_token_ids, llm.context_length,
                      EngineConfig(**{"kv_cache_dtype": "float32", **cfg}), isa=llm.engine.cache.isa)


def greedy(c: EngineCore, prompts: dict[str, list[int]], n: int = 32) -> dict[str, list[int]]:
    """Request id -> ``n`` greedy tokens of each prompt, all added at once and stepped to the end."""
    params = quill.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    for rid, p in prompts.items():
        c.add_request(rid, p, params)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while c.has_unfinished_requests():
        for o in c.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


def scored(llm, prompt: list[int], chunk: int = 256, **cfg) -> torch.Tensor:
    """quill's log-probability of every prompt token after the first, through the engine's paged cache
    (prefilled ``chunk`` tokens per step; ``cfg``: more EngineConfig fields, e.g. ``block_size``)."""
    c = engine_core(llm, max_num_batched_tokens=chunk, **cfg)
    c.add_request("s", prompt, quill.SamplingParams(max_tokens=1), score=ScoreSpec())
    got = None
    while c.has_unfinished_requests():
        for o in c.step():
            got = o.scores.token_logprobs if o.scores is not None else got
    return got


def staggered(c: EngineCore, prompts: list[list[int]], params, arrivals: dict[int, list[int]]) -> dict:
    """request -> (tokens, sorted top log-probabilities per token): prompt ``i`` added at the step ``arrivals``
    names for it (indices past ``prompts`` skipped), the engine stepped until every request ends."""
    out: dict[str, tuple[list, list]] = {}
    arrivals, step = dict(arrivals), 0
    while c.has_unfinished_requests() or arrivals:
        for i in arrivals.pop(step, []):
            if i < len(prompts):
                c.add_request(str(i), prompts[i], params)
        for o in c.step():
            toks, lps = out.setdefault(o.request_id, ([], []))
            toks.extend(o.new_token_ids)
            lps.extend(sorted((k, v.logprob) for k, v in d.items()) for d in o.logprobs)
        step += 1
    return out


# ---- a quantized checkpoint against transformers' float32 forward of the same weights -------------

def assert_checkpoint_logprobs(d, prompt: list[int], want: torch.Tensor, kernel: str | None) -> None:
    """quill's log-probabilities of every next token over the whole vocabulary at every position of ``prompt``
    within 1e-3 of ``want`` [len(prompt) - 1, vocab] and the same argmax, on ``kernel`` (None: the native one,
    in its exact mode)."""
    llm = quill.LLM(str(d), kernel=kernel, skip_tokenizer_init=True, kv_cache_dtype="float32", progress=False,
                    activation_quant="exact")
    n, vocab = len(prompt) - 1, llm.model.args.vocab_size
    spec = ScoreSpec(first=1, gather_ids=torch.arange(vocab).expand(n, -1).contiguous())
    got = llm.score([prompt], spec)[0].gathered
    err = float((got - want).abs().max())
    assert err <= 1e-3, (str(d), kernel, err)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    kernels = {i.kernel for i in llm.loaded.layers if i.kind == "quantized"}
    assert kernels == ({"reference"} if kernel else {"native_w4a16"}), kernels


def assert_checkpoint_greedy(d, hf, ids: list[int], native_step: bool = False) -> None:
    """32 greedy tokens after ``ids`` equal transformers' ``generate``; ``native_step``: on the native decode step."""
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    llm = quill.LLM(str(d), skip_tokenizer_init=True, kv_cache_dtype="float32", progress=False)
    if native_step:
        assert llm.engine.native_step is not None, llm.engine.native_step_reason
    got = llm.generate([ids], quill.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
    assert got == want
