"""The text of one generated sequence: streaming detokenization with stop strings held back.

A piece of text is released only when no stop string could still begin in it,
so a stop string is never emitted, not even in part, while streaming.
"""

from __future__ import annotations

from quill.tokenizer import IncrementalDetokenizer


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class SequenceText:
    """Accumulates one sequence's text from its tokens; reports a stop string when one appears."""

    def __init__(self, detokenizer: IncrementalDetokenizer | None, stops: tuple[str, ...] = ()):
        self.detok = detokenizer
        self.stops = stops
        self.text = ""  # released so far
        self.pending = ""  # decoded but held back (could begin a stop string)
        self.stopped_by: str | None = None

    def add(self, token_id: int, emit: bool = True, last: bool = False) -> str:
        """Feed one token; return the text released by it.

        ``emit=False`` for a token that ends the sequence without being text
        (EOS, a stop token id).  ``last=True`` releases everything held back.
        """
        if self.detok is None or self.stopped_by is not None:
            return ""
        if emit:
            self.pending += self.detok.add(token_id)
        if last:
            self.pending += self.detok.flush()
        out = self._release(last)
        self.text += out
        return out

    def _release(self, last: bool) -> str:
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            at, stop = min(hits)
            self.stopped_by = stop
            out, self.pending = self.pending[:at], ""
            return out
        keep = 0 if last else _held_back(self.pending, self.stops)
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out
