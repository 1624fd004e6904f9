"""Scoring prompts: the log-probability a model gives each prompt token, for perplexity and KL.

A scored request runs like any other (chunked prefill, paged KV, continuous batching) and
keeps, for every prompt position from ``ScoreSpec.first`` on, the log-probability of the
token actually there, the model's own argmax, and optionally its top-k log-probabilities or
its log-probabilities at ids given per position (another model's top-k, for KL).  Results
are tensors, not per-token dicts: evaluations score tens of thousands of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quill.errors import GenerationError


@dataclass(frozen=True, eq=False)
class ScoreSpec:
    """What to keep for the prompt tokens ``first .. len(prompt) - 1`` (token i is predicted at position i - 1)."""

    first: int = 1
    top_k: int = 0  # keep the k most likely ids and their log-probs at each scored position
    gather_ids: torch.Tensor | None = None  # int64 [n_scored, g]: also keep the log-probs at these ids

    def check(self, prompt_len: int, vocab: int, label: str) -> None:
        if isinstance(self.first, bool) or not isinstance(self.first, int) or not 1 <= self.first < prompt_len:
            raise GenerationError(f"{label}: the first scored token must be in [1, {prompt_len - 1}] for a "
                                  f"{prompt_len}-token prompt, found {self.first!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k <= vocab:
            raise GenerationError(f"{label}: top_k must be in [0, {vocab}], found {self.top_k!r}")
        g = self.gather_ids
        if g is not None:
            n = prompt_len - self.first
            if g.dtype != torch.int64 or g.dim() != 2 or g.shape[0] != n:
                raise GenerationError(f"{label}: gather_ids must be int64 [{n}, g] (one row per scored token), "
                                      f"found {g.dtype} {list(g.shape)}")
            if g.numel() and (int(g.min()) < 0 or int(g.max()) >= vocab):
                raise GenerationError(f"{label}: gather_ids hold ids outside the vocabulary [0, {vocab})")


@dataclass
class PromptScores:
    """Per scored prompt token (rows in prompt order, starting at ``first``)."""

    first: int
    token_logprobs: torch.Tensor  # float32 [n]: log p(prompt[i] | prompt[:i])
    argmax: torch.Tensor  # int64 [n]: the model's most likely token at each position
    top_ids: torch.Tensor | None = None  # int64 [n, k]
    top_logprobs: torch.Tensor | None = None  # float32 [n, k]
    gathered: torch.Tensor | None = None  # float32 [n, g]: log-probs at ScoreSpec.gather_ids


class ScoreAccumulator:
    """Collects one sequence's scored rows chunk by chunk (chunked prefill scores a prompt in pieces)."""

    def __init__(self, spec: ScoreSpec, prompt: list[int]):
        self.spec, self.prompt = spec, prompt
        self.parts: list[PromptScores] = []
        self.next = spec.first  # the next prompt token to score

    def positions(self, start: int, n: int) -> range:
        """Of the positions ``start .. start + n - 1`` computed this step, those whose next token is scored.

        Positions scored before are skipped: a preempted sequence recomputes them to the same values."""
        lo = max(start, self.next - 1)
        return range(lo, max(lo, min(start + n, len(self.prompt) - 1)))

    def add(self, logits: torch.Tensor, positions: range) -> None:
        """logits float32 [len(positions), V] of ``positions`` (each predicts the token after it)."""
        if not len(positions):
            return
        if positions.start != self.next - 1:
            raise GenerationError(f"scored positions out of order: expected {self.next - 1}, got {positions.start}")
        lps = torch.log_softmax(logits.float(), -1)  # [n, V]
        targets = torch.tensor(self.prompt[positions.start + 1:positions.stop + 1], dtype=torch.int64)
        part = PromptScores(positions.start + 1, lps.gather(1, targets[:, None])[:, 0], lps.argmax(-1))
        if self.spec.top_k:
            part.top_logprobs, part.top_ids = torch.topk(lps, self.spec.top_k, dim=-1)
        if self.spec.gather_ids is not None:
            lo = positions.start + 1 - self.spec.first
            part.gathered = lps.gather(1, self.spec.gather_ids[lo:lo + len(positions)])
        self.parts.append(part)
        self.next = positions.stop + 1

    def done(self) -> bool:
        return self.next >= len(self.prompt)

    def result(self) -> PromptScores:
        p = self.parts

        def cat(name):
            vals = [getattr(x, name) for x in p]
            return None if vals[0] is None else torch.cat(vals)
        return PromptScores(self.spec.first, cat("token_logprobs"), cat("argmax"), cat("top_ids"),
                            cat("top_logprobs"), cat("gathered"))
