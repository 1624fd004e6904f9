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
