"""Speculative decoding inside continuous batching: draft, verify in one forward, keep what agrees.

A decoding sequence with drafts d_1..d_k runs k + 1 positions in one step: its last sampled token and
the k drafts.  ``StepLayout`` makes each generated-token position a decode row with its own context
length (as a preempted sequence's recompute), so row i's logits are, bit for bit, what the i-th of
k + 1 ordinary decode steps would compute had d_1..d_i been sampled.  Tokens are then taken one at a
time through the core's own per-token path (penalties over the output so far, logit_bias, min_tokens,
EOS / stop tokens / max_tokens, log-probs), and the first token that differs from its draft, or the
first finish, ends the step:

* greedy: the token is the argmax, as always; a draft is kept when it equals it.  Greedy output is
  therefore the non-speculative output by construction.
* sampling: the standard rejection rule for a one-hot draft distribution: keep d with probability
  p(d) (p: exactly the distribution ordinary sampling draws from), else draw from p with d removed
  and renormalised (max(p - q, 0) for q one-hot at d); after k kept drafts the last row gives a bonus
  token.  Each emitted token then has p's law given the tokens before it, as without speculation.

Rejected positions are rolled back: the computed-token count ends at the last kept token and blocks
past it go back to the pool.  Requests held to a grammar (structured outputs) do not speculate: the
matcher cannot be rolled back, and checking drafts against it is not done yet.  Neither do models with
recurrent state (their state after a rejected token cannot be undone).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from quill.engine.draft import DraftModelProposer
from quill.engine.ngram import NgramProposer
from quill.engine.sampling import SamplingParams, sample_token, sampling_probs
from quill.engine.sequence import Sequence
from quill.engine.spec_config import SpeculativeConfig

PAUSE_MAX = 32  # decode steps a sequence whose drafts keep failing waits at most before proposing again
PROPOSER_FAULTS = 3  # proposer failures in a row (no success between) before the engine stops speculating

log = logging.getLogger("quill.engine")


@dataclass
class SpecState:
    """One sequence's adaptive speculation: how many drafts it gets and whether it is paused."""

    k: int  # drafts to ask for next (1 .. num_speculative_tokens)
    misses: int = 0  # verifications in a row that kept no draft
    paused: int = 0  # decode steps left without proposing
    off: bool = False  # the proposer failed while drafting for it: plain decoding from then on

    def update(self, drafted: int, kept: int, k_max: int) -> None:
        """After a verification: grow k back while drafts are kept, halve it and pause (doubling the pause)
        while none is, so free text that repeats nothing costs next to nothing."""
        if kept:
            self.misses, self.k = 0, min(k_max, kept + 1)
            return
        self.misses += 1
        self.k = max(1, self.k // 2)
        if self.misses >= 2:
            self.paused = min(PAUSE_MAX, 2 ** (self.misses - 1))


@dataclass
class SpecCounters:
    """Cumulative, for /metrics (vLLM's spec_decode_* names)."""

    num_drafts: int = 0  # verifications that had at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class Speculator:
    """Proposes drafts for the scheduler and verifies them for the core."""

    def __init__(self, config: SpeculativeConfig, context_length: int,
                 proposer: "NgramProposer | DraftModelProposer | None" = None):
        """``proposer``: what drafts (default: n-gram lookup; the engine builds a DraftModelProposer)."""
        self.config, self.context_length = config, context_length
        self.proposer = proposer or NgramProposer(config)
        self.counters = SpecCounters()
        self.faults = 0  # proposer failures in a row
        self.off = False  # PROPOSER_FAULTS of them: no sequence speculates any more

    def propose(self, seq: Sequence, budget: int) -> list[int]:
        """Drafts for ``seq`` alone (``propose_many`` for a step's sequences at once)."""
        k = self.wants(seq, budget)
        return self.propose_many([(seq, k)])[0] if k else []

    def propose_many(self, items: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Drafts for each (sequence, k) from ``wants``, in one go (a draft model runs them batched).

        Drafts only ever save time, so a proposer that raises (a draft model's forward, say) costs no
        request anything: the sequences it drafted for go on decoding plainly (the same output), and it is
        logged once per failure."""
        if not items:
            return []
        try:
            drafts = self.proposer.propose_many(items)
        except Exception as e:  # any failure of an optional speed-up; the engine's own errors are elsewhere
            self._proposer_failed([seq for seq, _ in items], e)
            return [[] for _ in items]
        self.faults = 0
        return drafts

    def _proposer_failed(self, seqs: list[Sequence], error: Exception) -> None:
        """``seqs`` stop speculating (what the proposer holds for them goes back); after PROPOSER_FAULTS failures
        in a row the engine does (a proposer that always fails would cost a forward per new request)."""
        self.faults += 1
        for seq in seqs:
            seq.spec.off = True
            self.proposer.release(seq)
        self.off = self.faults >= PROPOSER_FAULTS
        log.warning("speculative decoding: the %s proposer failed (%s: %s); %s go on without drafts%s",
                    self.config.method, type(error).__name__, error,
                    ", ".join(f"request {seq.request_id}" for seq in seqs),
                    f"; speculation is now off for this engine ({self.faults} failures in a row)" if self.off else "",
                    exc_info=error)

    def wants(self, seq: Sequence, budget: int) -> int:
        """How many drafts ``seq``'s next step should have (at most ``budget``; 0 when they cannot pay)."""
        if (self.off or seq.grammar is not None or seq.scorer is not None
                or seq.params.structured_outputs is not None):
            return 0
        state = seq.spec
        if state is None:
            state = seq.spec = SpecState(self.config.num_speculative_tokens)
        if state.off:
            return 0
        if state.paused:
            state.paused -= 1
            return 0
        k = min(state.k, budget, self.context_length - seq.num_tokens - 1)
        if seq.params.max_tokens is not None:  # the step's last token is the correction or bonus
            k = min(k, seq.params.max_tokens - len(seq.output) - 1)
        return max(0, k)

    def record(self, seq: Sequence, drafted: int, kept: int) -> None:
        """After ``seq``'s verification: the counters, its adaptive k, and the proposer's rollback."""
        self.counters.num_drafts += 1
        self.counters.num_draft_tokens += drafted
        self.counters.num_accepted_tokens += kept
        seq.spec.update(drafted, kept, self.config.num_speculative_tokens)
        self.proposer.rollback(seq)

    def release(self, seq: Sequence) -> None:
        """``seq`` left the running set (finished, aborted, preempted): what the proposer holds for it goes."""
        self.proposer.release(seq)


def verify_token(processed: torch.Tensor, params: SamplingParams, draft: int, generator: torch.Generator) -> int:
    """The token at a drafted position from processed logits [V]: ``draft`` when the rule keeps it, else a
    token != ``draft`` (see the module docstring)."""
    if params.greedy:  # the ordinary sampler's own argmax
        return sample_token(processed, params, torch.empty(0, dtype=torch.int64), generator)
    probs = sampling_probs(processed, params)  # [V], what sample_token draws from
    if float(torch.rand((), generator=generator)) < float(probs[draft]):
        return draft
    residual = probs.clone()
    residual[draft] = 0.0  # max(p - q, 0) for q one-hot at the draft; multinomial renormalises
    if not float(residual.sum()) > 0.0:  # p(draft) == 1 rounds so; it cannot be rejected then
        return draft
    return int(torch.multinomial(residual, 1, generator=generator))


def verify(speculator: Speculator, seq: Sequence, logits: torch.Tensor, rows: list[int], sample, blocks):
    """``seq`` ran its last token and its drafts (``rows``: their logits rows, k + 1): take tokens one at a
    time through ``sample(seq, logits_row, draft)`` (the core's per-token path, a StepOutput each) until
    one differs from its draft or finishes; roll the rest back.  One StepOutput with every token taken."""
    drafts, seq.drafts = seq.drafts, []
    seq.num_computed += 1  # the last sampled token's KV, computed this step
    outs = []
    for i, row in enumerate(rows):
        draft = drafts[i] if i < len(drafts) else None
        out = sample(seq, logits[row], draft)
        outs.append(out)
        if out.finish_reason is not None or out.new_token_ids[0] != draft:
            break
        seq.num_computed += 1  # a kept draft: the KV its row wrote holds
    kept = sum(o.new_token_ids[0] == d for o, d in zip(outs, drafts))
    speculator.record(seq, len(drafts), kept)
    if seq.finish_reason is None:  # a finished sequence's blocks are already back in the pool
        blocks.trim(seq)  # the rejected positions' blocks
        blocks.register_computed(seq)
    first, last = outs[0], outs[-1]
    return dataclasses.replace(
        first, new_token_ids=[t for o in outs for t in o.new_token_ids],
        logprobs=None if first.logprobs is None else [lp for o in outs for lp in o.logprobs],
        finish_reason=last.finish_reason, stop_reason=last.stop_reason)
