"""What speculation costs and what it earns, so a step drafts only where drafts pay.

A decode step of B sequences emits B tokens in T(B).  Drafting k_i tokens for sequence i makes the step
B + sum(k_i) rows and adds the proposer's time D (a draft model's forwards; n-gram lookup costs nothing
here); it emits B + sum(E_i) tokens, E_i = a_i + a_i^2 + ... + a_i^k_i for a sequence whose drafts are
each kept with probability a_i.  ``plan`` picks the k_i with the most tokens per second, none when no
plan beats plain decoding.  On a memory-bound step (one stream: T flat in the rows) drafts are nearly
free and almost any acceptance pays; on a compute-bound one (many streams, or a big model's prefill-like
verify) a row costs about T(B) / B and only drafts kept nearly always do, so speculation switches itself
off under load without a batch-size threshold to tune (vLLM's ``disable_by_batch_size``).

T and the draft's forward time are measured, not modelled: ``StepTimes`` keeps a recent average per row
count and interpolates between the counts it has seen.  A count past every one seen is assumed to cost
what the largest did, and one below every one seen a proportional share of the smallest: either guess
favours the step that has not been measured, so it runs and is measured.  Before any step was measured,
and now and then after the plan kept refusing, one sequence drafts (``explore``).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

EWMA = 0.25  # weight of a slower measurement in its row count's average (a faster one replaces it)
MAX_ROWS = 1024  # row counts past this are not kept (prefill-sized steps say nothing about drafts)
EXPLORE_EVERY = 50  # every this many refusals one sequence drafts anyway, refreshing the times the plan rests on


class StepTimes:
    """Seconds per step by row count: a recent average per count seen, linear between counts."""

    def __init__(self):
        self.rows: list[int] = []  # sorted row counts seen
        self.secs: dict[int, float] = {}

    def record(self, rows: int, seconds: float) -> None:
        """Fast down, slow up: a step cannot run faster than the machine allows, so a faster measurement is
        taken at once (a cold first step, 50x the warm one, must not hold a row count off for good), while
        a slower one, a busier host or noise, moves the average a quarter of the way."""
        if rows < 1 or rows > MAX_ROWS or not seconds > 0.0:
            return
        old = self.secs.get(rows)
        if old is None:
            self.rows.insert(bisect_left(self.rows, rows), rows)
            self.secs[rows] = seconds
        else:
            self.secs[rows] = seconds if seconds < old else old + EWMA * (seconds - old)

    def __call__(self, rows: int) -> float | None:
        """The expected seconds of a ``rows``-row step; None before anything was measured."""
        if not self.rows:
            return None
        if rows in self.secs:
            return self.secs[rows]
        i = bisect_left(self.rows, rows)
        if i == len(self.rows):  # past every count seen: as the largest (optimistic, so it gets measured)
            return self.secs[self.rows[-1]]
        hi = self.rows[i]
        if i == 0:  # below every count seen: as if compute-bound (pessimistic, so plain steps get measured too)
            return self.secs[hi] * rows / hi
        lo = self.rows[i - 1]
        t_lo, t_hi = self.secs[lo], self.secs[hi]
        return t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)


@dataclass
class Candidate:
    """One sequence that may draft: its acceptance estimate, most drafts, and a draft model's catch-up rows."""

    accept: float  # probability that each of its drafts is kept (given the ones before it were)
    k_max: int
    # tokens the draft model feeds before its first draft: those the last verification kept, or a whole prompt
    # the draft has not read (quill.engine.speculative.Speculator.prefill did not run it); n-gram lookup: unused
    catch_up: int = 1


def explore(cands: list[Candidate]) -> list[int]:
    """Drafts for one sequence, the cheapest for a draft model to catch up, then the likeliest kept: what a
    draft step costs gets measured at little risk."""
    out = [0] * len(cands)
    if cands:
        best = max(range(len(cands)), key=lambda i: (-cands[i].catch_up, cands[i].accept, cands[i].k_max))
        out[best] = cands[best].k_max
    return out


def plan(decodes: int, cands: list[Candidate], target: StepTimes, draft: StepTimes | None) -> list[int]:
    """Drafts per candidate for a step with ``decodes`` decoding sequences: the prefix of all (sequence, j-th
    draft) pairs, most likely kept first, with the most expected tokens per second; all zeros when plain
    decoding is as fast.  Unmeasured times mean "try it" (see the module docstring)."""
    base_t = target(decodes)
    if base_t is None or (draft is not None and not draft.rows):
        return explore(cands)
    pairs = sorted(((c.accept ** j, i) for i, c in enumerate(cands) for j in range(1, c.k_max + 1)),
                   key=lambda p: -p[0])
    ks = [0] * len(cands)
    # a draft model's forwards: the first catches each drafting sequence up and gives its first draft, each
    # further one feeds back the previous draft of the sequences still drafting (rows per forward)
    forwards = [0] * (1 + max((c.k_max for c in cands), default=0))
    best_rate, best_len = decodes / base_t, 0
    tokens = float(decodes)
    for n, (gain, i) in enumerate(pairs, start=1):
        forwards[ks[i] + 1] += cands[i].catch_up if ks[i] == 0 else 1
        ks[i] += 1
        tokens += gain
        seconds = target(decodes + n)
        if draft is not None:
            seconds += sum(draft(r) or 0.0 for r in forwards if r)
        if tokens / seconds > best_rate:
            best_rate, best_len = tokens / seconds, n
    out = [0] * len(cands)
    for _, i in pairs[:best_len]:
        out[i] += 1
    return out
