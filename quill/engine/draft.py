"""The draft-model proposer (vLLM's ``draft_model``): a smaller model (or a lower-bit copy of the target)
guesses the next k tokens greedily; the target checks them in one forward (``quill.engine.speculative``).

The draft keeps its own paged KV blocks (``DraftKV``, out of the engine's budget: quill.engine.pools) and,
per sequence, which of the sequence's tokens they hold.  Each step, for every sequence that proposes at
once: one forward catches the draft up on the tokens it has not seen (the prompt, chunked like any
prefill, and the tokens the last verification kept) and gives each its first draft (a prompt is caught up as
it finishes, ``prefill``, so the wait falls before the first token, as in llama-server); then one forward per
further draft position feeds the previous draft back, until a run's k tokens or a token that would finish the
request (EOS, a stop token: nothing after it can be kept).  After verification the draft's tokens are cut back
to the common prefix with the sequence's (rolled back; blocks past it freed).  A draft is one-hot (its
argmax), so the target's rejection rule (``verify_token``) keeps the output distribution exact.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn

from quill.engine.kv_cache import PagedKVCache, StepLayout
from quill.engine.sequence import Sequence
from quill.engine.spec_cost import StepTimes
from quill.errors import ConfigError
from quill.models.base import ForwardContext

FIELD = "speculative_config.model"


# ---- the same-tokenizer check (before anything loads) ----------------------------------------------------
def vocabulary(path: Path) -> list[str] | None:
    """The token strings by id, read from the GGUF metadata or ``tokenizer.json`` (no weights); None when
    neither is there."""
    if path.is_file() and path.suffix == ".gguf":
        from quill.formats.gguf.file import GGUFFile
        tokens = GGUFFile(path).metadata.get("tokenizer.ggml.tokens")
        return None if tokens is None else list(tokens)
    spec = path / "tokenizer.json"
    if not spec.is_file():
        return None
    data = json.loads(spec.read_text(encoding="utf-8"))
    ids = dict(data.get("model", {}).get("vocab", {}))
    ids.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
    out = [""] * (max(ids.values(), default=-1) + 1)
    for text, i in ids.items():
        out[i] = text
    return out


def check_same_tokenizer(target: Path, draft: Path) -> None:
    """A ConfigError unless ``draft`` tokenizes as ``target`` does (same size, same token strings)."""
    t, d = vocabulary(target), vocabulary(draft)
    for name, path, v in (("target", target, t), ("draft", draft, d)):
        if v is None:
            raise ConfigError(f"{FIELD}: cannot read the {name}'s vocabulary from {path} (no GGUF tokenizer "
                              "metadata, no tokenizer.json); supported: GGUF files and checkpoint directories")
    if len(t) != len(d):
        raise ConfigError(f"{FIELD}: the draft {draft} has {len(d)} tokens, the target {len(t)}; supported: a "
                          "draft with the target's tokenizer")
    for i, (a, b) in enumerate(zip(t, d)):
        if a != b:
            raise ConfigError(f"{FIELD}: the draft {draft}'s token {i} is {b!r}, the target's {a!r}; supported: a "
                              "draft with the target's tokenizer")


# ---- the draft's KV ------------------------------------------------------------------------------------------
@dataclass
class DraftState:
    """One sequence's place in the draft's cache: its blocks and the tokens whose KV they hold."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


class DraftKV:
    """The draft's block pool: a free list (no prefix caching: a draft's blocks live as long as its sequence)."""

    def __init__(self, cache: PagedKVCache):
        self.cache, self.block_size = cache, cache.block_size
        self.free = list(range(cache.num_blocks - 1, -1, -1))  # popped from the end: block 0 first

    @property
    def num_used(self) -> int:
        return self.cache.num_blocks - len(self.free)

    def room(self, st: DraftState, num_tokens: int) -> int:
        """Grow ``st`` towards ``num_tokens`` positions from free blocks; how many positions it now has."""
        want = -(-num_tokens // self.block_size) - len(st.blocks)
        for _ in range(min(max(0, want), len(self.free))):
            st.blocks.append(self.free.pop())
        return len(st.blocks) * self.block_size

    def cut(self, st: DraftState, keep: int) -> None:
        """Keep ``st``'s first ``keep`` tokens; the blocks past them go back."""
        del st.tokens[keep:]
        while len(st.blocks) > -(-keep // self.block_size):
            self.free.append(st.blocks.pop())


def _common(a: list[int], b: list[int]) -> int:
    """The length of ``a`` and ``b``'s common prefix (most often all of ``a``: compared in C first)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModelProposer:
    """Greedy drafts from a draft model for many sequences at once (``propose_many``)."""

    cheap = False  # its forwards cost: the plan (quill.engine.spec_cost) says first who drafts how many

    def __init__(self, model: nn.Module, cache: PagedKVCache, max_tokens: int, vocab: int,
                 eos: frozenset[int] = frozenset()):
        """``cache``: the draft's pools (quill.engine.pools); ``max_tokens``: a catch-up forward's tokens at most
        (the engine's step budget: a long prompt is caught up in chunks); ``vocab``: the target's vocabulary
        size (a draft whose embedding is padded wider never proposes a token past it); ``eos``: the target's
        EOS tokens (a draft run ends at one, as at a request's stop token)."""
        self.model, self.kv, self.max_tokens, self.vocab = model, DraftKV(cache), max_tokens, vocab
        self.eos = eos
        self.context_length = model.args.context_length  # no position past the draft's own window
        self.native_step, _ = model.native_decode_step(cache, None)
        self.states: dict[Sequence, DraftState] = {}
        self.times = StepTimes()  # its forwards' seconds by rows (catch-ups too), for the plan

    def catch_up(self, seq: Sequence) -> int:
        """Tokens of ``seq`` the draft has not seen (after the rollback ``propose_many`` would make)."""
        st = self.states.get(seq)
        held = 0 if st is None else min(_common(st.tokens, seq.tokens), seq.num_tokens - 1)
        return seq.num_tokens - held

    def propose_many(self, items: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to k greedy draft tokens for each (sequence, k); [] for one still catching up or out of blocks."""
        drafts: list[list[int]] = [[] for _ in items]
        pieces, ks, budget = [], [], self.max_tokens
        for i, (seq, k) in enumerate(items):
            k = min(k, self.context_length - seq.num_tokens)
            if k < 1:
                continue
            # room for the catch-up and k - 1 fed-back drafts (the k-th is never fed)
            st, todo, new, have = self._take(seq, seq.num_tokens, budget, reserve=k - 1)
            if not new:
                continue
            budget -= len(new)
            done = len(new) == len(todo)
            pieces.append((i, st, len(seq.prompt), new))
            ks.append(min(k, have - len(new) + 1) if done else 0)
        firsts = self._forward([(st, p, new) for _, st, p, new in pieces]) if pieces else []
        live = []  # (index, state, prompt length, k) of those that caught up: they draft
        for (i, st, p, _), k, first in zip(pieces, ks, firsts):
            if k > 0:
                drafts[i].append(first)
                live.append((i, st, p, k))
        while True:  # one forward per further draft position, for the runs not done
            step = [(i, st, p) for i, st, p, k in live
                    if len(drafts[i]) < k and not self._ends(items[i][0], drafts[i][-1])]
            if not step:
                return drafts
            nxt = self._forward([(st, p, [drafts[i][-1]]) for i, st, p in step])
            for (i, _, _), d in zip(step, nxt):
                drafts[i].append(d)

    def prefill(self, seqs: list[Sequence]) -> None:
        """Catch the draft up on ``seqs``' tokens but the last (their prompts, as they finish), chunked by the step
        budget, so their first proposal feeds one token; one left over (no free blocks) catches up then."""
        pending = list(seqs)
        while pending:
            pieces, rest, budget = [], [], self.max_tokens
            for seq in pending:
                st, todo, new, _ = self._take(seq, seq.num_tokens - 1, budget)
                if not new:
                    continue
                budget -= len(new)
                pieces.append((st, len(seq.prompt), new))
                if len(new) < len(todo):
                    rest.append(seq)
                if not budget:
                    break
            if not pieces:
                return
            self._forward(pieces)
            pending = rest

    def _take(self, seq: Sequence, end: int, budget: int,
              reserve: int = 0) -> tuple[DraftState, list[int], list[int], int]:
        """``seq``'s draft state, rolled back; the tokens before ``end`` it has not seen (``todo``); those one forward
        takes (``new``: at most ``budget``, as many as free blocks hold with ``reserve`` positions more after them);
        the positions its blocks now have past its tokens."""
        st = self.states.setdefault(seq, DraftState())
        self.rollback(seq)
        todo = seq.tokens[len(st.tokens):end]
        new = todo[:budget]
        if not new:
            return st, todo, [], 0
        have = self.kv.room(st, len(st.tokens) + len(new) + reserve) - len(st.tokens)
        return st, todo, new[:have], have

    def _ends(self, seq: Sequence, token: int) -> bool:
        """Whether ``token`` ends ``seq``'s draft run: a draft after it is never kept (the target stops there
        if it keeps the token, and a rejected token rejects what follows), so drafting on wastes a forward.
        The set of tokens that finish a request, or that min_tokens masks (the same set)."""
        p = seq.params
        return token in p.stop_token_ids or (token in self.eos and not p.ignore_eos)

    def rollback(self, seq: Sequence) -> None:
        """Cut the draft's tokens back to what ``seq`` still holds (at least its last token is fed again)."""
        st = self.states.get(seq)
        if st is not None:
            self.kv.cut(st, min(_common(st.tokens, seq.tokens), seq.num_tokens - 1))

    def release(self, seq: Sequence) -> None:
        """``seq`` finished, was aborted or preempted: its draft blocks go back."""
        st = self.states.pop(seq, None)
        if st is not None:
            self.kv.cut(st, 0)

    def _forward(self, pieces: list[tuple[DraftState, int, list[int]]]) -> list[int]:
        """Run each (state, prompt length, new tokens) in one packed forward; the argmax after each piece's last."""
        tokens, positions, layout, want = [], [], [], []
        for st, prompt_len, new in pieces:
            done = len(st.tokens)
            tokens += new
            positions += range(done, done + len(new))
            layout.append((st.blocks, done, len(new), prompt_len))
            want.append(len(tokens) - 1)
        lay = StepLayout.build(layout, self.kv.block_size)
        index = torch.tensor(want, dtype=torch.int64)
        started = time.perf_counter()
        if self.native_step is not None and lay.all_decodes():
            ctx = ForwardContext(torch.tensor([positions]), None, None, index,
                                 layers=partial(self.native_step, lay, state_rows=None))
        else:
            ctx = ForwardContext(torch.tensor([positions]), None, self.kv.cache.views(lay), logits_indices=index)
        logits = self.model(torch.tensor([tokens]), ctx)[0]
        for st, _, new in pieces:
            st.tokens += new
        drafts = logits[:, :self.vocab].argmax(-1).tolist()
        self.times.record(len(tokens), time.perf_counter() - started)  # a catch-up's cost too
        return drafts
