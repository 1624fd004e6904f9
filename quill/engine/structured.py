"""Structured outputs: a request's output held to a JSON schema, any JSON object, a regex, a choice or an
EBNF grammar, on xgrammar (vLLM's default backend).

    params = SamplingParams(structured_outputs=StructuredOutputs(json={"type": "object", ...}))

``StructuredOutputs`` says what (vLLM's field names).  ``GrammarCompiler`` (one per model: the
tokenizer's vocabulary as xgrammar reads it is built once, on first use) parses a spec in the caller's
thread, so an invalid one is a ``StructuredOutputError`` naming its field before anything is queued,
and compiles it on a worker thread, once per distinct spec (a bounded LRU of futures), so a large schema
does not stall the engine's steps.  The engine gives each constrained request a matcher
(``GrammarCompiler.matcher``), fills a row of a token bitmask from it before sampling, and advances it
with every sampled token.

xgrammar is an optional dependency (the ``structured`` extra): without it a constrained request is
refused with an error that says how to install it.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from quill.errors import GenerationError

INSTALL_HINT = "pip install 'quill[structured]'   (xgrammar==0.2.8)"
CACHE_SIZE = 32  # compiled grammars kept (each holds a mask cache over the vocabulary: ~0.1-10 MB)
COMPILE_THREADS = 2  # xgrammar's threads for one compile (the machine is shared with the decode step)
KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputError(GenerationError):
    """An invalid structured-output spec; ``source`` names the request field it came from."""

    def __init__(self, message: str, source: str):
        super().__init__(message)
        self.source = source


@dataclass
class StructuredOutputs:
    """One constraint on a request's output (exactly one of the fields; vLLM's names).

    ``json``: a JSON schema (dict or JSON text); ``regex``: a regular expression; ``choice``: one of these
    strings exactly; ``grammar``: an EBNF grammar in xgrammar's dialect (GBNF-like; its ``root`` rule is the
    start); ``json_object``: any JSON object.  ``disable_any_whitespace``: JSON without free whitespace
    between tokens (vLLM's flag).  ``source``: the request field it came from, named in errors (the
    server sets e.g. "response_format")."""

    json: dict | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    source: str = "structured_outputs"
    key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            found = ", ".join(given) or "none"
            raise StructuredOutputError(f"{self.source}: expected exactly one of {', '.join(KINDS)}, "
                                        f"found {found}", self.source)
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                value = _json_text(value, f"{self.source}.json")
            if not isinstance(value, (dict, bool)):
                raise StructuredOutputError(f"{self.source}.json: expected a JSON schema (an object), found "
                                            f"{type(value).__name__}", self.source)
            text = json.dumps(value)  # key order kept: properties are generated in the schema's order
        elif kind == "choice":
            if isinstance(value, str) or not value or not all(isinstance(c, str) and c for c in value):
                raise StructuredOutputError(f"{self.source}.choice: expected a non-empty list of non-empty "
                                            f"strings, found {value!r}", self.source)
            self.choice = tuple(value)
            text = json.dumps(self.choice)
        elif kind == "json_object":
            if value is not True:
                raise StructuredOutputError(f"{self.source}.json_object: expected true, found {value!r}", self.source)
            text = ""
        else:
            if not isinstance(value, str) or not value:
                raise StructuredOutputError(f"{self.source}.{kind}: expected a non-empty string, found {value!r}",
                                            self.source)
            text = value
        self.key = (kind, text, bool(self.disable_any_whitespace))

    @property
    def kind(self) -> str:
        return self.key[0]


def _json_text(text: str, name: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise StructuredOutputError(f"{name}: not valid JSON ({e})", name.split(".")[0]) from None


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise GenerationError(f"structured outputs need xgrammar, which is not installed: {INSTALL_HINT}") from None
    return xgrammar


class GrammarCompiler:
    """Parses and compiles structured-output specs for one model's tokenizer (see the module).

    ``compiles`` counts grammars compiled (cache misses); a spec seen before reuses its compile."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = CACHE_SIZE):
        """``tokenizer``: a ``quill.tokenizer.Tokenizer``; ``vocab_size``: the model's (logits' width, which
        may exceed the tokenizer's: padding)."""
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self.compiles = 0
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()  # the server checks on its event loop, the engine adds on its thread
        self._compiler = None  # built by the worker on first use
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="quill-grammar")  # its thread starts then

    def _compile(self, grammar):
        """On the worker: xgrammar's compiler over this tokenizer (built once: ~1 s for 50k tokens), then
        ``grammar`` compiled against it (its per-token mask cache: ~0.5-1 s for a small JSON schema)."""
        if self._compiler is None:
            xgr = _xgrammar()
            info = tokenizer_info(xgr, self.tokenizer, self.vocab_size, self.eos_token_ids)
            # our own LRU decides what is kept (and counts compiles); xgrammar's cache would double it
            self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
        return self._compiler.compile_grammar(grammar)

    def parse(self, spec: StructuredOutputs):
        """``spec`` as an xgrammar ``Grammar``; a ``StructuredOutputError`` naming its field if invalid."""
        xgr = _xgrammar()
        kind, text, compact = spec.key
        try:
            if kind == "json":
                return xgr.Grammar.from_json_schema(text, any_whitespace=not compact, strict_mode=True)
            if kind == "json_object":
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=not compact)
            if kind == "regex":
                return xgr.Grammar.from_regex(text)
            if kind == "choice":
                return xgr.Grammar.from_ebnf(choice_grammar(spec.choice))
            return xgr.Grammar.from_ebnf(text)
        except Exception as e:  # whatever xgrammar's parsers raise on user input is the user's error (400, not 500)
            what = {"json": "JSON schema", "regex": "regex", "grammar": "EBNF grammar"}.get(kind, kind)
            name = spec.source if spec.source != "structured_outputs" else f"structured_outputs.{kind}"
            raise StructuredOutputError(f"{name}: invalid {what}: {_first_line(e)}", spec.source) from None

    def compile(self, spec: StructuredOutputs) -> Future:
        """A future of ``spec``'s compiled grammar: parsed here (errors raised now), compiled on the worker
        thread unless an earlier request compiled it already."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None and not (hit.done() and hit.exception() is not None):
                self._cache.move_to_end(spec.key)
                return hit
        grammar = self.parse(spec)
        with self._lock:
            hit = self._cache.get(spec.key)  # another thread may have compiled it meanwhile
            if hit is None:
                hit = self._executor.submit(self._compile, grammar)
                self.compiles += 1
                self._cache[spec.key] = hit
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            return hit

    def matcher(self, compiled) -> "GrammarState":
        return GrammarState(_xgrammar().GrammarMatcher(compiled))

    def bitmask(self, rows: int) -> torch.Tensor:
        return _xgrammar().allocate_token_bitmask(rows, self.vocab_size)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[16:41:26] /project/cpp/x.cc:83: "


def _first_line(e: Exception) -> str:
    lines = [s for s in str(e).splitlines() if s.strip()]
    return _LOG_PREFIX.sub("", lines[0]) if lines else type(e).__name__


class GrammarState:
    """One request's matcher: which tokens may come next, advanced token by token.

    A preempted request keeps its output (it recomputes the KV, it does not sample it again), so the
    matcher, which has seen exactly that output, needs no rollback."""

    def __init__(self, matcher):
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise GenerationError(f"token {token} was sampled although the grammar does not allow it")

    @property
    def terminated(self) -> bool:
        """The grammar accepted its stop token: nothing more may come."""
        return self.matcher.is_terminated()


def constrain(logits: torch.Tensor, sampled: list, grammars: GrammarCompiler | None) -> None:
    """Before sampling, in the rows of ``logits`` [N, V] sampled this step (``sampled``: (sequence, row)):
    the grammar's bitmask of constrained requests (forbidden tokens -inf), then their ``logit_bias``
    (vLLM's order: both before penalties and temperature), in place."""
    masked = [(seq, row) for seq, row in sampled if seq.grammar is not None]
    if masked:
        bitmask = grammars.bitmask(len(masked))
        for i, (seq, _) in enumerate(masked):
            seq.grammar.fill(bitmask, i)
        apply_bitmask(logits, bitmask, [row for _, row in masked], grammars.vocab_size)
    biased = [(row, t, v) for seq, row in sampled for t, v in (seq.params.logit_bias or {}).items()]
    if biased:
        rows, ids, values = zip(*biased)
        logits.index_put_((torch.tensor(rows), torch.tensor(ids)), torch.tensor(values, dtype=logits.dtype),
                          accumulate=True)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """Set the logits the bitmask forbids to -inf, in rows ``rows`` of ``logits`` [N, V] (bitmask row i for
    ``rows[i]``), in place."""
    xgr = _xgrammar()
    if logits.shape[1] != vocab_size:
        raise GenerationError(f"logits have {logits.shape[1]} columns, the grammar's vocabulary {vocab_size}")
    sub = logits[rows]
    # xgrammar's C++ loop; unpacking the bits with torch ops measured 3-4x slower (1 and 16 rows)
    xgr.apply_token_bitmask_inplace(sub, bitmask[:len(rows)], vocab_size=vocab_size, backend="cpu")
    logits[rows] = sub


def tokenizer_info(xgr, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
    """xgrammar's view of a quill tokenizer: every id's token text (padding ids beyond the tokenizer's
    vocabulary are empty, so never allowed), how texts map to bytes (byte-level, byte-fallback or raw:
    read from the tokenizer's own JSON, as xgrammar's ``from_huggingface`` does) and the stop tokens."""
    backend = tokenizer.spec.tokenizer
    vocab = backend.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for token, idx in vocab.items():
        if idx < vocab_size:
            encoded[idx] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=list(eos_token_ids) or None, add_prefix_space=meta["add_prefix_space"])
