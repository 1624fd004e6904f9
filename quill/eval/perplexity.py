"""Strided-window perplexity over one tokenized text (the transformers perplexity guide's windows).

Windows of ``context`` tokens start every ``stride`` tokens; each scores only the tokens no
earlier window scored, so every token but the first is scored exactly once, with at least
``context - stride`` tokens before it (all of them in the first window).  The text is
tokenized once, without a chat template.  PPL = exp(mean NLL over scored tokens), with the
standard error of the mean NLL carried through (as llama-perplexity reports it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quill.engine.scoring import PromptScores, ScoreSpec
from quill.errors import EvalError


@dataclass(frozen=True)
class Window:
    """Tokens ``begin:end`` of the text; window positions ``first ..`` are scored."""

    begin: int
    end: int
    first: int  # relative to begin, >= 1

    @property
    def scored(self) -> int:
        return self.end - self.begin - self.first


def make_windows(num_tokens: int, context: int, stride: int, max_context: int | None = None) -> list[Window]:
    """The windows over ``num_tokens`` tokens (an EvalError names a bad argument)."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 2:
        raise EvalError(f"--context must be at least 2 tokens, found {context!r}")
    if max_context is not None and context > max_context:
        raise EvalError(f"--context {context} is larger than the model's context window of {max_context} tokens")
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= context:
        raise EvalError(f"--stride must be in [1, --context={context}], found {stride!r}")
    if num_tokens < 2:
        raise EvalError(f"the text has {num_tokens} token(s); perplexity needs at least 2")
    out, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + context, num_tokens)
        out.append(Window(begin, end, max(prev_end - begin, 1)))
        prev_end = end
        if end == num_tokens:
            break
    return out


@dataclass
class Perplexity:
    """The figures of one run (``as_dict`` is what ``--json`` writes)."""

    perplexity: float
    perplexity_stderr: float
    mean_nll: float
    tokens_evaluated: int
    tokens_processed: int  # every window's tokens (overlaps count again)
    windows: int
    context: int
    stride: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_processed / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {"perplexity": self.perplexity, "perplexity_stderr": self.perplexity_stderr,
                "mean_nll": self.mean_nll, "tokens_evaluated": self.tokens_evaluated,
                "tokens_processed": self.tokens_processed, "windows": self.windows, "context": self.context,
                "stride": self.stride, "seconds": self.seconds, "tokens_per_second": self.tokens_per_second}

    def report(self) -> str:
        return (f"perplexity {self.perplexity:.4f} +/- {self.perplexity_stderr:.4f}  "
                f"({self.tokens_evaluated} tokens evaluated in {self.windows} windows of {self.context}, "
                f"stride {self.stride}; {self.tokens_per_second:.0f} tok/s over {self.seconds:.1f} s)")


def nll_stats(nll: torch.Tensor) -> tuple[float, float]:
    """(mean, standard error of the mean) of per-token NLLs, in float64."""
    x = nll.double()
    n = x.numel()
    se = float(x.std(unbiased=True)) / math.sqrt(n) if n > 1 else 0.0
    return float(x.mean()), se


def score_windows(llm, tokens: list[int], windows: list[Window], top_k: int = 0,
                  gather: list[torch.Tensor] | None = None,
                  progress: Callable[[int], None] | None = None) -> list[PromptScores]:
    """Every window scored through the engine in one batch (continuous batching, chunked prefill)."""
    specs = [ScoreSpec(w.first, top_k, None if gather is None else gather[i]) for i, w in enumerate(windows)]
    return llm.score([tokens[w.begin:w.end] for w in windows], specs, progress=progress)


def perplexity_from(scores: list[PromptScores], windows: list[Window], context: int, stride: int,
                    seconds: float) -> Perplexity:
    nll = -torch.cat([s.token_logprobs for s in scores])
    mean, se = nll_stats(nll)
    ppl = math.exp(mean)
    return Perplexity(ppl, ppl * se, mean, nll.numel(), sum(w.end - w.begin for w in windows), len(windows),
                      context, stride, seconds)


def perplexity(llm, tokens: list[int], context: int = 512, stride: int = 256,
               progress: Callable[[int], None] | None = None) -> Perplexity:
    """Perplexity of ``llm`` over ``tokens`` (see the module docstring)."""
    windows = make_windows(len(tokens), context, stride, llm.context_length)
    t0 = time.perf_counter()
    scores = score_windows(llm, tokens, windows, progress=progress)
    return perplexity_from(scores, windows, context, stride, time.perf_counter() - t0)
