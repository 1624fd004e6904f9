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


class NgramProposer:
    """Drafts for one sequence from its prompt and output tokens (``propose``); keeps no state.  Beside it
    behind the same ``propose_many`` / ``rollback`` / ``release``: ``quill.engine.draft.DraftModelProposer``."""

    def __init__(self, config: SpeculativeConfig):
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if k < 1 or len(tokens) <= self.n_min:
            return []
        return lookup(np.asarray(tokens, dtype=np.int64), k, self.n_min, self.n_max)

    def propose_many(self, items: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [self.propose(seq.tokens, k) for seq, k in items]

    def rollback(self, seq: Sequence) -> None:  # nothing kept per sequence
        pass

    def release(self, seq: Sequence) -> None:
        pass
