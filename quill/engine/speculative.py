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

Which sequences draft, and how many tokens, is planned each step (``quill.engine.spec_cost``): from measured
step times by row count and each sequence's recent acceptance, the drafts with the most expected tokens
per second, none when plain decoding is faster (a batch that is compute-bound, text the proposer cannot
guess).  ``adaptive: false`` in the config drafts every step instead.

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
from quill.engine.spec_cost import EXPLORE_EVERY, Candidate, StepTimes, explore, plan

PROPOSER_FAULTS = 3  # proposer failures in a row (no success between) before the engine stops speculating
SEQ_DECAY = 0.8  # a sequence's acceptance counts fade by this per verification: its recent text counts most
ENGINE_DECAY = 0.98  # the engine-wide counts (a new sequence's prior) fade more slowly
PRIOR_WEIGHT = 2.0  # how many drafts' worth of evidence the engine-wide rate counts for in a sequence's estimate
SKIP_DECAY = 0.9  # a sequence not drafting this step: its counts fade towards the engine-wide rate (retried)

log = logging.getLogger("quill.engine")


@dataclass
class SpecState:
    """One sequence's recent drafts: kept and rejected counts (fading), and whether it speculates at all."""

    kept: float = 0.0  # drafts kept, recent ones weighing most
    rejected: float = 0.0  # verifications that rejected a draft
    off: bool = False  # the proposer failed while drafting for it: plain decoding from then on

    def update(self, drafted: int, kept: int, decay: float = SEQ_DECAY) -> None:
        """After a verification of ``drafted`` drafts of which the first ``kept`` were kept."""
        self.kept = self.kept * decay + kept
        self.rejected = self.rejected * decay + (kept < drafted)

    def accept(self, prior: float) -> float:
        """The probability that a draft is kept, given that the ones before it were (a geometric run model)."""
        return (self.kept + PRIOR_WEIGHT * prior) / (self.kept + self.rejected + PRIOR_WEIGHT)


@dataclass
class SpecCounters:
    """Cumulative, for /metrics (vLLM's spec_decode_* names)."""

    num_drafts: int = 0  # verifications that had at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class Speculator:
    """Proposes drafts for the scheduler and verifies them for the core; drafts only where they pay
    (``quill.engine.spec_cost``: measured step times against each sequence's acceptance)."""

    def __init__(self, config: SpeculativeConfig, context_length: int,
                 proposer: "NgramProposer | DraftModelProposer | None" = None):
        """``proposer``: what drafts (default: n-gram lookup; the engine builds a DraftModelProposer)."""
        self.config, self.context_length = config, context_length
        self.proposer = proposer or NgramProposer(config)
        self.counters = SpecCounters()
        self.engine_rate = SpecState()  # every sequence's verifications: a new sequence's prior
        self.step_times = StepTimes()  # the target's decode steps (EngineCore.step records them)
        self.refusals = 0  # steps whose plan drafted nothing, since the last one run anyway (EXPLORE_EVERY)
        self.faults = 0  # proposer failures in a row
        self.off = False  # PROPOSER_FAULTS of them: no sequence speculates any more

    def propose_many(self, items: list[tuple[Sequence, int]], decodes: int) -> list[list[int]]:
        """Drafts for each (sequence, most drafts from ``wants``) of a step with ``decodes`` decoding sequences,
        as many as pay (``plan``).  A cheap proposer (n-gram lookup) proposes first, so the plan counts only
        the drafts there are; a draft model runs only what the plan gives (batched).

        Drafts only ever save time, so a proposer that raises (a draft model's forward, say) costs no
        request anything: the sequences it drafted for go on decoding plainly (the same output), and it is
        logged once per failure."""
        if not items:
            return []
        try:
            if self.proposer.cheap:
                drafts = self.proposer.propose_many(items)
                ks = self.plan([(seq, len(d)) for (seq, _), d in zip(items, drafts)], decodes)
                drafts = [d[:k] for d, k in zip(drafts, ks)]
            else:
                ks = self.plan(items, decodes)
                drafts = [[] for _ in items]
                run = [(n, (seq, k)) for n, ((seq, _), k) in enumerate(zip(items, ks)) if k]
                for (n, _), d in zip(run, self.proposer.propose_many([item for _, item in run])):
                    drafts[n] = d
        except Exception as e:  # any failure of an optional speed-up; the engine's own errors are elsewhere
            self._proposer_failed([seq for seq, _ in items], e)
            return [[] for _ in items]
        self.faults = 0
        return drafts

    def plan(self, items: list[tuple[Sequence, int]], decodes: int) -> list[int]:
        """How many of its most drafts each (sequence, k) runs this step: all of them when the config says
        ``adaptive: false``, else the plan with the most expected tokens per second (spec_cost.plan)."""
        if not self.config.adaptive:
            return [k for _, k in items]
        cands = self._candidates(items, [self.proposer.catch_up(seq) for seq, _ in items])
        ks = plan(decodes, cands, self.step_times, self.proposer.times)
        if any(ks):
            self.refusals = 0
        elif any(k for _, k in items):
            self.refusals += 1
            if self.refusals >= EXPLORE_EVERY:  # now and then anyway: the times it refuses on may be stale
                self.refusals, ks = 0, explore(cands)
        for (seq, want), k in zip(items, ks):
            if want and not k:  # not drafting: its counts fade towards the engine's rate, so it is retried
                seq.spec.kept *= SKIP_DECAY
                seq.spec.rejected *= SKIP_DECAY
        return ks

    def _candidates(self, items: list[tuple[Sequence, int]], catch_up: list[int]) -> list[Candidate]:
        """The plan's view of each (sequence, most drafts): its acceptance (the engine's rate as prior)."""
        prior = self.engine_rate.accept(0.5)
        return [Candidate(seq.spec.accept(prior), k, c) for (seq, k), c in zip(items, catch_up)]

    def prefill(self, seqs: list[Sequence], running: int) -> None:
        """``seqs`` finished their prompts this step, ``running`` sequences are running: a draft model reads the
        prompts now, rather than at their first proposal, of those the plan would have draft in a step of all
        ``running`` decoding (under load, none: a prompt the draft reads for nothing costs a prefill)."""
        if self.off or self.proposer.cheap:
            return
        items = [(seq, k) for seq in seqs if (k := self.wants(seq, self.config.num_speculative_tokens))]
        if self.config.adaptive and items:
            # as if read: the plan weighs the drafts after it (the read itself is paid once per request)
            cands = self._candidates(items, [1] * len(items))
            ks = plan(max(running, len(items)), cands, self.step_times, self.proposer.times)
            items = [item for item, k in zip(items, ks) if k]
        seqs = [seq for seq, _ in items]
        if not seqs:
            return
        try:
            self.proposer.prefill(seqs)
        except Exception as e:  # as in propose_many: an optional speed-up failed, the requests go on
            self._proposer_failed(seqs, e)

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
        """How many drafts ``seq``'s next step may have at most (``budget``, its context and max_tokens; 0 when
        it cannot speculate)."""
        if (self.off or seq.grammar is not None or seq.scorer is not None
                or seq.params.structured_outputs is not None):
            return 0
        if seq.spec is None:
            seq.spec = SpecState()
        if seq.spec.off:
            return 0
        k = min(self.config.num_speculative_tokens, budget, self.context_length - seq.num_tokens - 1)
        if seq.params.max_tokens is not None:  # the step's last token is the correction or bonus
            k = min(k, seq.params.max_tokens - len(seq.output) - 1)
        return max(0, k)

    def record(self, seq: Sequence, drafted: int, kept: int) -> None:
        """After ``seq``'s verification: the counters, its acceptance, and the proposer's rollback."""
        self.counters.num_drafts += 1
        self.counters.num_draft_tokens += drafted
        self.counters.num_accepted_tokens += kept
        seq.spec.update(drafted, kept)
        self.engine_rate.update(drafted, kept, ENGINE_DECAY)
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
