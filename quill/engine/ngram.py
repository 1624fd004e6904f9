"""N-gram prompt lookup (vLLM's ``ngram`` proposer): guess the next tokens by copying what followed the
last time the sequence's latest tokens appeared.

Text that quotes, edits or summarises its prompt repeats it; a sequence whose last n tokens occurred
before is likely to go on as it went on then.  No model runs: a draft costs a search of the sequence's
own tokens, and the target model checks it (``quill.engine.speculative``), so a wrong guess costs
only the positions it added to that step.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from quill.engine.sequence import Sequence
from quill.engine.spec_config import SpeculativeConfig


def lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the last n tokens of ``tokens``
    (int64 [L]), n tried from ``n_max`` down to ``n_min``; [] when no suffix occurred before."""
    size = tokens.shape[0]
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        # windows that start early enough that a token follows them: starts 0 .. size - n - 1
        windows = sliding_window_view(tokens[:size - 1], n)  # [size - n, n], a view
        hits = np.flatnonzero((windows == tokens[size - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent occurrence
            return tokens[start:start + k].tolist()
    return []


class NgramIndex:
    """``lookup`` for one growing token list in O(n_max) a step: for each n, where the latest occurrence of
    every n-gram that has a token after it ends.  Tokens are only ever appended (a sequence's kept tokens), so
    the index only grows with them."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.follow: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max + 1)]  # [n]: n-gram -> next index
        self.seen = 0  # tokens[:seen] are indexed: every n-gram ending before seen - 1

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """As ``lookup(np.asarray(tokens), k, n_min, n_max)``; ``tokens`` extends the list seen before."""
        size = len(tokens)
        for end in range(max(1, self.seen), size):  # n-grams tokens[end - n:end], followed by tokens[end]
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.follow[n][tuple(tokens[end - n:end])] = end
        self.seen = size
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            start = self.follow[n].get(tuple(tokens[size - n:]))
            if start is not None:
                return tokens[start:start + k]
        return []


class NgramProposer:
    """Drafts for one sequence from its prompt and output tokens (``propose``), from its ``NgramIndex``.  Beside it
    behind the same ``propose_many`` / ``rollback`` / ``release``: ``quill.engine.draft.DraftModelProposer``."""

    cheap = True  # a lookup costs next to nothing: it runs before the plan, which then counts real drafts
    times = None  # no forwards of its own

    def __init__(self, config: SpeculativeConfig):
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max
        self.indexes: dict[Sequence, NgramIndex] = {}

    def catch_up(self, seq: Sequence) -> int:  # nothing to catch up
        return 0

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = seq.tokens
        if k < 1 or len(tokens) <= self.n_min:
            return []
        index = self.indexes.get(seq)
        if index is None:
            index = self.indexes[seq] = NgramIndex(self.n_min, self.n_max)
        return index.lookup(tokens, k)

    def propose_many(self, items: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [self.propose(seq, k) for seq, k in items]

    def rollback(self, seq: Sequence) -> None:  # drafts never enter the index: nothing to undo
        pass

    def release(self, seq: Sequence) -> None:
        self.indexes.pop(seq, None)
