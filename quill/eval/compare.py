"""KL divergence of a model against a base, per token, the way ``llama-perplexity --kl-divergence`` reports it.

The base is scored once over the text's windows and keeps, at every scored token, its
top-k log-probabilities (``--top-k``, default 128) besides its own NLL and argmax; this can be
saved (safetensors) and reused.  The other model is scored over the same windows, keeping its
log-probabilities at the base's top-k ids.  KL(base || other) per token is taken over those k
ids plus one "rest" outcome holding the remaining mass of each distribution: the KL of both
distributions coarse-grained the same way, never above the full-vocabulary KL (data processing)
and equal to it when k is the vocabulary size.  Two identical models give exactly 0.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from quill.errors import EvalError
from quill.eval.perplexity import Window, make_windows, nll_stats, score_windows

FORMAT = "quill-eval-base/1"


def token_digest(tokens: list[int]) -> str:
    return hashlib.sha256(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes()).hexdigest()


@dataclass
class BaseScores:
    """A base model's scores over one text's windows (what ``--save-base`` writes)."""

    model: str  # what was scored (for the report)
    tokens: list[int]
    context: int
    stride: int
    token_logprobs: torch.Tensor  # float32 [S], S = scored tokens over all windows
    argmax: torch.Tensor  # int64 [S]
    top_ids: torch.Tensor  # int64 [S, K]
    top_logprobs: torch.Tensor  # float32 [S, K]

    @property
    def windows(self) -> list[Window]:
        return make_windows(len(self.tokens), self.context, self.stride)

    def save(self, path: str | os.PathLike) -> None:
        """Write as safetensors, atomically (a temp file renamed into place)."""
        from safetensors.torch import save_file
        path = Path(path)
        meta = {"format": FORMAT, "model": self.model, "context": str(self.context), "stride": str(self.stride),
                "tokens_sha256": token_digest(self.tokens)}
        tensors = {"tokens": torch.tensor(self.tokens, dtype=torch.int64),
                   "token_logprobs": self.token_logprobs.contiguous(), "argmax": self.argmax.contiguous(),
                   "top_ids": self.top_ids.to(torch.int32).contiguous(),
                   "top_logprobs": self.top_logprobs.contiguous()}
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> BaseScores:
        """Read a file ``save`` wrote (an EvalError says what is wrong with any other)."""
        from safetensors import SafetensorError, safe_open
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT:
                    raise EvalError(f"{path}: not a quill base-scores file (format {meta.get('format')!r}, "
                                    f"expected {FORMAT!r}; write one with `quill eval compare --save-base`)")
                t = {k: f.get_tensor(k) for k in ("tokens", "token_logprobs", "argmax", "top_ids", "top_logprobs")}
        except (SafetensorError, OSError) as e:
            raise EvalError(f"{path}: cannot read base scores: {e}") from e
        tokens = t["tokens"].tolist()
        if token_digest(tokens) != meta.get("tokens_sha256"):
            raise EvalError(f"{path}: its tokens do not match their recorded digest (a damaged file)")
        out = cls(meta.get("model", "?"), tokens, int(meta["context"]), int(meta["stride"]), t["token_logprobs"],
                  t["argmax"], t["top_ids"].to(torch.int64), t["top_logprobs"])
        scored = sum(w.scored for w in out.windows)
        if any(x.shape[0] != scored for x in (out.token_logprobs, out.argmax, out.top_ids, out.top_logprobs)):
            raise EvalError(f"{path}: expected {scored} scored tokens for its windows, the tensors disagree")
        return out


def score_base(llm, tokens: list[int], context: int, stride: int, top_k: int, model: str,
               progress=None) -> BaseScores:
    """Score the base model once, keeping its top-k log-probabilities at every scored token."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= llm.model.args.vocab_size:
        raise EvalError(f"--top-k must be in [1, {llm.model.args.vocab_size}], found {top_k!r}")
    windows = make_windows(len(tokens), context, stride, llm.context_length)
    scores = score_windows(llm, tokens, windows, top_k=top_k, progress=progress)
    return BaseScores(model, list(tokens), context, stride, torch.cat([s.token_logprobs for s in scores]),
                      torch.cat([s.argmax for s in scores]), torch.cat([s.top_ids for s in scores]),
                      torch.cat([s.top_logprobs for s in scores]))


def topk_kl(base_lp: torch.Tensor, other_lp: torch.Tensor) -> torch.Tensor:
    """KL(base || other) per row [S] over k ids + the rest; both float [S, k] log-probs at the same ids.

    A rest mass below ``REST_EPS`` (the float32 rounding of a sum of k probabilities) counts as none,
    so k = vocabulary gives the full KL, not a rounding artefact."""
    lp, lq = base_lp.double(), other_lp.double()
    p = lp.exp()
    kl = (p * (lp - lq)).sum(-1)
    rest_p = 1.0 - p.sum(-1)
    rest_q = (1.0 - lq.exp().sum(-1)).clamp(min=REST_EPS)
    rest = torch.where(rest_p > REST_EPS, rest_p * (rest_p.clamp(min=REST_EPS).log() - rest_q.log()), 0.0)
    return (kl + rest).clamp(min=0.0)  # float rounding may leave -1e-17 where both agree


REST_EPS = 1e-6


@dataclass
class Comparison:
    """KL(base || other), top-1 agreement and the perplexity ratio over the same scored tokens."""

    base: str
    other: str
    tokens_evaluated: int
    top_k: int
    ppl_base: float
    ppl_other: float
    ppl_base_stderr: float
    ppl_other_stderr: float
    ln_ppl_ratio: float  # mean(NLL_other - NLL_base)
    ln_ppl_ratio_stderr: float
    kl_mean: float
    kl_stderr: float
    kl_median: float
    kl_p99: float
    kl_max: float
    top1_agreement: float
    top1_stderr: float
    seconds: float

    @property
    def ppl_ratio(self) -> float:
        return math.exp(self.ln_ppl_ratio)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["ppl_ratio"] = self.ppl_ratio
        return d

    def report(self) -> str:
        return "\n".join([
            f"base:  {self.base}", f"other: {self.other}",
            f"tokens evaluated          {self.tokens_evaluated} (KL over the base's top {self.top_k} + rest)",
            f"PPL(base)                 {self.ppl_base:.4f} +/- {self.ppl_base_stderr:.4f}",
            f"PPL(other)                {self.ppl_other:.4f} +/- {self.ppl_other_stderr:.4f}",
            f"PPL(other)/PPL(base)      {self.ppl_ratio:.5f}  (ln ratio {self.ln_ppl_ratio:.5f} "
            f"+/- {self.ln_ppl_ratio_stderr:.5f})",
            f"KL divergence mean        {self.kl_mean:.6f} +/- {self.kl_stderr:.6f}",
            f"KL divergence median      {self.kl_median:.6f}", f"KL divergence p99         {self.kl_p99:.6f}",
            f"KL divergence max         {self.kl_max:.6f}",
            f"same top-1                {100 * self.top1_agreement:.3f} +/- {100 * self.top1_stderr:.3f} %",
        ])


def compare(base: BaseScores, llm, tokens: list[int], other: str, progress=None) -> Comparison:
    """Score ``llm`` over the base's windows and compare (an EvalError if the texts' tokens differ)."""
    if list(tokens) != base.tokens:
        raise EvalError(f"the base scored {len(base.tokens)} tokens (sha256 {token_digest(base.tokens)[:12]}) but "
                        f"this model's tokenizer gives {len(tokens)} (sha256 {token_digest(tokens)[:12]}) for the "
                        f"text: compare needs the same text and the same tokenizer")
    windows = make_windows(len(tokens), base.context, base.stride, llm.context_length)
    sizes = [w.scored for w in windows]
    t0 = time.perf_counter()
    scores = score_windows(llm, tokens, windows, gather=list(base.top_ids.split(sizes)), progress=progress)
    seconds = time.perf_counter() - t0
    nll_o = -torch.cat([s.token_logprobs for s in scores]).double()
    nll_b = -base.token_logprobs.double()
    kl = topk_kl(base.top_logprobs, torch.cat([s.gathered for s in scores]))
    same = (torch.cat([s.argmax for s in scores]) == base.argmax).double()
    n = kl.numel()
    ratio, ratio_se = nll_stats(nll_o - nll_b)
    kl_mean, kl_se = nll_stats(kl)
    (mb, sb), (mo, so) = nll_stats(nll_b), nll_stats(nll_o)
    agree = float(same.mean())
    return Comparison(base.model, other, n, base.top_ids.shape[1], math.exp(mb), math.exp(mo),
                      math.exp(mb) * sb, math.exp(mo) * so, ratio, ratio_se, kl_mean, kl_se, float(kl.median()),
                      float(torch.quantile(kl, 0.99)), float(kl.max()), agree,
                      math.sqrt(agree * (1 - agree) / n), seconds)
