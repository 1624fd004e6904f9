"""Sampling parameters (vLLM's names and defaults), logits processing, and log-probabilities."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from quill.engine.structured import StructuredOutputs
from quill.errors import GenerationError


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop (the fields vLLM users know).

    temperature 0 is greedy, and so is any temperature below ``SAMPLING_EPS`` (vLLM's
    threshold: dividing logits by less overflows them).  ``top_k`` 0 or -1, ``top_p`` 1 and ``min_p`` 0
    disable those filters.  ``min_tokens``: EOS and stop tokens are masked until that
    many tokens exist.  ``presence_penalty`` / ``frequency_penalty`` (OpenAI's, in
    [-2, 2]) lower the logits of generated tokens once / per occurrence.  ``stop``
    strings end generation and are not part of the text; ``stop_token_ids`` and EOS (unless ``ignore_eos``) end it too.
    ``logprobs=k`` returns, for each generated token, the k most likely tokens'
    log-probabilities plus the sampled token's own; ``prompt_logprobs=k`` does
    the same for every prompt position after the first.  ``-1`` means the whole
    vocabulary.  Log-probabilities are those of the model's raw distribution
    (before temperature, penalties and filters), as vLLM reports them.
    ``seed`` is any integer ``torch.Generator.manual_seed`` takes, in [-2**63, 2**64 - 1];
    ``repetition_penalty`` is in [0.01, 100] (see ``REPETITION_PENALTY``).  Token ids
    (``stop_token_ids``) are checked against the vocabulary when the engine takes the request
    (``PromptLimits.check_params``).  ``structured_outputs`` holds the output to a JSON schema, regex,
    choice or grammar (``quill.engine.structured``); ``logit_bias`` adds {token id: bias in [-100, 100]}
    to the logits before sampling (OpenAI's; -100 bans a token, +100 all but forces it).
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[int, float] | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self):
        _check_int(self.max_tokens, "max_tokens", 1, allow_none=True)
        _check_int(self.min_tokens, "min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise GenerationError(f"SamplingParams.min_tokens: {self.min_tokens} exceeds max_tokens {self.max_tokens}")
        _check_number(self.presence_penalty, "presence_penalty", lo=-2.0, hi=2.0)
        _check_number(self.frequency_penalty, "frequency_penalty", lo=-2.0, hi=2.0)
        _check_number(self.temperature, "temperature", lo=0.0)
        _check_int(self.top_k, "top_k", -1)
        _check_number(self.top_p, "top_p", lo=0.0, hi=1.0, lo_open=True)
        _check_number(self.min_p, "min_p", lo=0.0, hi=1.0)
        _check_number(self.repetition_penalty, "repetition_penalty", *REPETITION_PENALTY)
        _check_int(self.seed, "seed", SEED_MIN, allow_none=True, hi=SEED_MAX)
        _check_int(self.logprobs, "logprobs", -1, allow_none=True)
        _check_int(self.prompt_logprobs, "prompt_logprobs", -1, allow_none=True)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise GenerationError(f"SamplingParams.stop: expected non-empty strings, found {self.stop!r}")
        self.stop_strings = tuple(stop)
        ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise GenerationError(f"SamplingParams.stop_token_ids: expected token ids >= 0, found {ids!r}")
        self.stop_token_ids = ids
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise GenerationError(f"SamplingParams.structured_outputs: expected a StructuredOutputs, found "
                                  f"{type(self.structured_outputs).__name__}")
        self.logit_bias = _check_logit_bias(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


SAMPLING_EPS = 1e-5  # temperatures below are greedy (vLLM's _SAMPLING_EPS): 1e-40 overflowed every logit
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1  # what torch.Generator.manual_seed takes (negatives wrap around)
# A factor on the logits of seen tokens.  Far outside it they leave float32's range once divided by a
# small temperature (1e-300 made them inf and the sampler's probabilities NaN); in practice 1.0-1.5.
REPETITION_PENALTY = (0.01, 100.0)


LOGIT_BIAS = (-100.0, 100.0)  # OpenAI's bounds


def _check_logit_bias(bias) -> dict[int, float] | None:
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise GenerationError(f"SamplingParams.logit_bias: expected a dict of token id -> bias, found "
                              f"{type(bias).__name__}")
    for t, v in bias.items():
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise GenerationError(f"SamplingParams.logit_bias: key {t!r}: expected a token id >= 0")
        _check_number(v, f"logit_bias[{t}]", *LOGIT_BIAS)
    return {t: float(v) for t, v in bias.items()}


def _check_int(v, name: str, lo: int | None, allow_none: bool = False, hi: int | None = None) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo) or (hi is not None and v > hi):
        bound = f" in [{lo}, {hi}]" if hi is not None else ("" if lo is None else f" >= {lo}")
        raise GenerationError(f"SamplingParams.{name}: expected an integer{bound}, found {v!r}")


def _check_number(v, name: str, lo: float, hi: float | None = None, lo_open: bool = False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if ok:
        ok = (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}{']' if hi is not None else ')'}"
        raise GenerationError(f"SamplingParams.{name}: expected a finite number in {rng}, found {v!r}")


# ---- logits processing -------------------------------------------------------

def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty on tokens already in the prompt or output: divide positive logits, multiply negative."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    out = logits.clone()
    score = out[seen]
    out[seen] = torch.where(score < 0, score * penalty, score / penalty)
    return out


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """logits [V] with the tokens that top-k, then top-p, then min-p exclude set to -inf."""
    out = logits.clone()
    if top_k > 0 and top_k < out.numel():
        kth = torch.topk(out, top_k).values[-1]
        out[out < kth] = float("-inf")
    if top_p < 1.0:
        probs, order = torch.sort(torch.softmax(out, -1), descending=True)
        before = torch.cumsum(probs, -1) - probs  # mass of the tokens ranked above each one
        drop = before >= top_p  # the smallest prefix whose mass reaches top_p is kept
        drop[0] = False  # always the top token: a top_p below float32's range (5e-324) compares as 0 >= 0
        out[order[drop]] = float("-inf")
    if min_p > 0.0:
        probs = torch.softmax(out, -1)
        out[probs < min_p * probs.max()] = float("-inf")
    return out


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                   eos: frozenset[int]) -> torch.Tensor:
    """logits [V] after min_tokens masking and the repetition / presence / frequency penalties."""
    if len(output) < params.min_tokens:
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        if banned:
            logits = logits.clone()
            logits[torch.tensor(sorted(banned), dtype=torch.int64)] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(prompt + output, dtype=torch.int64)
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output:
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=logits.numel())
        counts = counts[:logits.numel()].to(logits.dtype)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor,
                 generator: torch.Generator) -> int:
    """One token id from float32 logits [V]."""
    logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, params), 1, generator=generator))


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution [V] a non-greedy ``sample_token`` draws from (temperature, then top-k / top-p / min-p);
    speculative verification keeps or rejects a draft against exactly this."""
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p, params.min_p)
    return torch.softmax(logits, -1)


# ---- log-probabilities -------------------------------------------------------

@dataclass(frozen=True)
class Logprob:
    """One token's log-probability, its rank (1 = most likely) and its text (when a tokenizer is loaded)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def token_logprobs(logprobs: torch.Tensor, token: int, k: int) -> dict[int, Logprob]:
    """The top-k entries of log-probabilities [V] plus ``token``'s own, keyed by token id (k=-1: all)."""
    k = logprobs.numel() if k == -1 else min(k, logprobs.numel())
    out: dict[int, Logprob] = {}
    chosen = float(logprobs[token])
    out[token] = Logprob(chosen, int((logprobs > logprobs[token]).sum()) + 1)
    if k:
        values, ids = torch.topk(logprobs, k)
        for rank, (v, i) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            if i != token:
                out[i] = Logprob(v, rank)
    return out
