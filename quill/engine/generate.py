"""Token-level generation: one forward step, and a batch of prompts decoded together.

Layers (mlx-lm style):

* :func:`forward_step`: one forward (prefill or decode) through a KV cache.
* :class:`BatchGenerator`: prefill a batch of token-id prompts (left-padded),
  then decode; each :meth:`~BatchGenerator.step` returns one :class:`TokenEvent`
  per live sequence.  Stop tokens, EOS, ``max_tokens`` and the context window
  end a sequence here; text-level stops (stop strings) are decided by the
  caller, which ends a sequence with :meth:`~BatchGenerator.finish`.
* ``quill.engine.llm``: text in, text out (streaming and batched).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from quill.engine.cache import KVCache
from quill.engine.sampling import Logprob, SamplingParams, sample_token, token_logprobs
from quill.errors import GenerationError


@torch.inference_mode()
def forward_step(model: nn.Module, cache: KVCache, tokens: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
    """Append ``tokens`` [B, T] to every row of ``cache``; float32 logits [B, T, V] (or [B, 1, V])."""
    ctx = cache.context(tokens.shape[1])
    logits = model(tokens, ctx, all_logits=all_logits)
    cache.advance(tokens.shape[1])
    return logits


@dataclass
class Timings:
    """Where the time of one request went (seconds, wall clock)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0  # the (batched) prefill forward and the first token
    decode_s: float = 0.0  # every later token

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        n = self.generated_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s else 0.0


@dataclass
class TokenEvent:
    """One generated token of one request."""

    index: int  # which prompt of the batch
    token_id: int
    logprobs: dict[int, Logprob] | None
    finish_reason: str | None  # None while the request goes on; "stop" or "length" at its last token
    stop_reason: int | None = None  # the stop token id that ended it (None for EOS)


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    output: list[int] = field(default_factory=list)
    prompt_logprobs: list | None = None
    timings: Timings = field(default_factory=Timings)
    finish_reason: str | None = None


class BatchGenerator:
    """Decode a batch of token-id prompts together through one KV cache."""

    def __init__(self, model: nn.Module, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                 eos_token_ids: Sequence[int], context_length: int, generator: torch.Generator,
                 pad_token_id: int = 0):
        if len(prompts) != len(params):
            raise GenerationError(f"{len(prompts)} prompts but {len(params)} sampling parameter sets")
        self.model = model
        self.vocab = model.args.vocab_size
        self.eos = frozenset(eos_token_ids)
        self.context_length = context_length
        self.requests = [self._request(i, p, sp, generator) for i, (p, sp) in enumerate(zip(prompts, params))]
        self.live: list[int] = []  # request indices, in cache row order
        self.cache: KVCache | None = None
        self.pad_token_id = pad_token_id
        self._next: torch.Tensor | None = None  # [B, 1] tokens to feed next

    def _request(self, i: int, prompt: Sequence[int], params: SamplingParams, gen: torch.Generator) -> _Request:
        ids = [int(t) for t in prompt]
        if not ids:
            raise GenerationError(f"prompt {i} is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise GenerationError(f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {self.vocab})")
        if len(ids) > self.context_length:
            raise GenerationError(f"prompt {i} has {len(ids)} tokens, longer than the context window of "
                                  f"{self.context_length} tokens")
        if params.seed is not None:
            gen = torch.Generator().manual_seed(params.seed)
        return _Request(ids, params, gen, timings=Timings(prompt_tokens=len(ids)))

    @property
    def done(self) -> bool:
        return self.cache is not None and not self.live

    def step(self) -> list[TokenEvent]:
        """Prefill (first call) or decode one token for every live request."""
        start = time.perf_counter()
        if self.cache is None:
            logits = self._prefill()
        else:
            self._drop_finished()
            if not self.live:
                return []
            logits = forward_step(self.model, self.cache, self._next)[:, -1]
        events = [self._sample(row, logits[row]) for row in range(len(self.live))]
        self._next = torch.tensor([[e.token_id] for e in events], dtype=torch.int64)
        spent = time.perf_counter() - start
        for e in events:
            t = self.requests[e.index].timings
            if t.generated_tokens == 1:
                t.prefill_s += spent
            else:
                t.decode_s += spent
        return events

    def finish(self, index: int, reason: str = "stop") -> None:
        """End request ``index`` (e.g. a stop string was found in its text)."""
        req = self.requests[index]
        if req.finish_reason is None:
            req.finish_reason = reason

    # ---- internals -----------------------------------------------------------
    def _prefill(self) -> torch.Tensor:
        """Left-pad the prompts, run them in one forward; logits of each row's last token [B, V]."""
        args = self.model.args
        lengths = [len(r.prompt) for r in self.requests]
        width = max(lengths)
        budget = max(self._budget(r) for r in self.requests)
        pad = torch.tensor([width - n for n in lengths])
        self.cache = KVCache(args.num_hidden_layers, pad, args.num_key_value_heads, args.head_dim,
                             min(width + budget, self.context_length), self.model.dtype)
        tokens = torch.full((len(lengths), width), self.pad_token_id, dtype=torch.int64)
        for row, r in enumerate(self.requests):
            tokens[row, width - len(r.prompt):] = torch.tensor(r.prompt)
        want_prompt = any(r.params.prompt_logprobs is not None for r in self.requests)
        logits = forward_step(self.model, self.cache, tokens, all_logits=want_prompt)  # [B, T or 1, V]
        self.live = list(range(len(self.requests)))
        if want_prompt:
            for row, r in enumerate(self.requests):
                if r.params.prompt_logprobs is not None:
                    r.prompt_logprobs = _prompt_logprobs(logits[row, width - len(r.prompt):], r.prompt,
                                                         r.params.prompt_logprobs)
        return logits[:, -1]

    def _budget(self, r: _Request) -> int:
        room = self.context_length - len(r.prompt)
        return room if r.params.max_tokens is None else min(room, r.params.max_tokens)

    def _sample(self, row: int, logits: torch.Tensor) -> TokenEvent:
        index = self.live[row]
        r = self.requests[index]
        seen = torch.tensor(r.prompt + r.output, dtype=torch.int64) if r.params.repetition_penalty != 1.0 else \
            torch.empty(0, dtype=torch.int64)
        token = sample_token(logits, r.params, seen, r.generator)
        lp = None
        if r.params.logprobs is not None:
            lp = token_logprobs(torch.log_softmax(logits, -1), token, r.params.logprobs)
        r.output.append(token)
        r.timings.generated_tokens = len(r.output)
        stop_reason = None
        if token in r.params.stop_token_ids:
            r.finish_reason, stop_reason = "stop", token
        elif token in self.eos and not r.params.ignore_eos:
            r.finish_reason = "stop"
        elif len(r.output) >= self._budget(r):  # max_tokens, or the context window is full
            r.finish_reason = "length"
        return TokenEvent(index, token, lp, r.finish_reason, stop_reason)

    def _drop_finished(self) -> None:
        keep = [row for row, i in enumerate(self.live) if self.requests[i].finish_reason is None]
        if len(keep) == len(self.live):
            return
        self.live = [self.live[row] for row in keep]
        if keep:
            rows = torch.tensor(keep, dtype=torch.int64)
            self.cache.keep(rows)
            self._next = self._next[rows]


def _prompt_logprobs(logits: torch.Tensor, prompt: list[int], k: int) -> list[dict[int, Logprob] | None]:
    """Per prompt position: None for the first, then the top-k (and the actual token) given the prefix."""
    lps = torch.log_softmax(logits[:-1].float(), -1)  # [n-1, V]: position i predicts token i+1
    return [None] + [token_logprobs(lps[i], prompt[i + 1], k) for i in range(len(prompt) - 1)]
