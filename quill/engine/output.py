"""From engine steps to what callers see: one request's text, tokens, log-probs and finish, step by step.

``OutputProcessor`` is the one loop around ``EngineCore`` that both the offline ``LLM`` and
the server's engine thread run: it adds requests (with their detokenizer and stop strings),
steps the core, turns each ``StepOutput`` into a ``StreamChunk`` (text released so far,
stop strings held back), and aborts a request in the core as soon as a stop string appears.
Single-threaded, like the core it drives.

A request that fails on its own (in the core's step, or here while its text is made) ends alone:
its last chunk has finish reason "error" and ``error`` says what failed; the others go on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from quill.engine.core import EngineCore, StepOutput
from quill.engine.sampling import Logprob, SamplingParams
from quill.engine.scoring import PromptScores, ScoreSpec
from quill.engine.sequence import Timings
from quill.engine.text import SequenceText
from quill.errors import GenerationError, QuillError
from quill.tokenizer import Tokenizer

log = logging.getLogger("quill.engine")


class RequestFailed(QuillError, RuntimeError):
    """A request ended by an error of its own inside the engine (the other requests went on)."""


@dataclass
class StreamChunk:
    """One step of one request: the new text (may be empty) and the token behind it.

    ``token_id`` is None only for a request that ended without a token (the KV pool could
    never hold its prompt); ``prompt_logprobs`` comes once, with the first chunk, when asked.
    """

    text: str
    token_id: int | None
    logprobs: dict[int, Logprob] | None
    finish_reason: str | None  # None while running; "stop", "length", "abort" or "error" at the end
    timings: Timings
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # finish_reason "error": what failed ("ExceptionType: message")


@dataclass(eq=False)
class RequestState:
    """What the text layer keeps for one request besides the engine's sequence."""

    rid: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    timings: Timings
    text: SequenceText
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    scores: PromptScores | None = None  # a scored request's prompt scores, once its prompt is computed
    error: str | None = None  # why it failed (finish_reason "error")


class OutputProcessor:
    """Adds requests to an ``EngineCore``, steps it, and turns its outputs into ``StreamChunk``s."""

    def __init__(self, core: EngineCore, tokenizer: Tokenizer | None):
        self.core, self.tokenizer = core, tokenizer
        self.states: dict[str, RequestState] = {}

    def add(self, rid: str, prompt: str | None, ids: list[int], params: SamplingParams,
            label: str | None = None, score: ScoreSpec | None = None) -> RequestState:
        """Queue one request in the core (a GenerationError names what is wrong with it)."""
        if params.stop_strings and self.tokenizer is None:
            raise GenerationError("stop strings need a tokenizer (this model was loaded with skip_tokenizer_init=True)")
        self.core.add_request(rid, ids, params, label=label, score=score)
        try:
            detok = None if self.tokenizer is None else self.tokenizer.detokenizer(ids, params.skip_special_tokens)
        except BaseException:
            self.core.fail_request(rid)
            raise
        state = RequestState(rid, prompt, list(ids), params, self.core.requests[rid].timings,
                             SequenceText(detok, params.stop_strings))
        self.states[rid] = state
        return state

    def abort(self, rid: str) -> RequestState | None:
        """End a request now (its blocks are freed at once); returns its state, None if unknown."""
        self.core.abort_request(rid)
        state = self.states.pop(rid, None)
        if state is not None and state.finish_reason is None:
            state.finish_reason = "abort"
        return state

    def has_work(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[tuple[RequestState, StreamChunk]]:
        """One engine step; a chunk for every request that produced a token or ended."""
        events = []
        for out in self.core.step():
            state = self.states.get(out.request_id)
            if state is None:  # aborted by its caller between steps
                continue
            for one in per_token(out):
                try:  # free in CPython 3.11 unless it raises
                    chunk = self._apply(state, one)
                except Exception as e:  # its text or log-probs failed: this request alone ends
                    chunk = self._failed(state, one, e)
                events.append((state, chunk))
                if state.finish_reason is not None:  # a stop string ends it here, whatever came after
                    self.states.pop(state.rid, None)
                    break
        return events

    def _failed(self, state: RequestState, out: StepOutput, error: Exception) -> StreamChunk:
        log.error("request %s failed while its output was made; the other requests go on", state.rid,
                  exc_info=error)
        self.core.fail_request(state.rid)  # its blocks are freed now
        state.finish_reason, state.error = "error", f"{type(error).__name__}: {error}"
        return StreamChunk("", None, None, "error", state.timings, None, out.num_prompt_tokens,
                           out.num_cached_tokens, error=state.error)

    def _apply(self, state: RequestState, out: StepOutput) -> StreamChunk:
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = [self.decorate(d) for d in out.prompt_logprobs]
        if out.scores is not None:
            state.scores = out.scores
        state.num_cached_tokens = out.num_cached_tokens
        finish = out.finish_reason
        token = out.new_token_ids[0] if out.new_token_ids else None
        piece, lp = "", None
        if token is not None:
            state.token_ids.append(token)
            as_token = finish == "stop"  # EOS or a stop token id: never part of the text
            piece = state.text.add(token, emit=not as_token, last=finish is not None)
            if state.text.stopped_by is not None and finish is None:
                self.core.abort_request(state.rid, "stop")
                finish = "stop"
            lp = self.decorate(out.logprobs[0]) if out.logprobs else None
            if lp is not None:
                state.logprobs.append(lp)
        state.finish_reason = finish
        if finish == "stop":
            state.stop_reason = state.text.stopped_by if state.text.stopped_by is not None else out.stop_reason
        state.error = out.error
        first = len(state.token_ids) <= 1
        return StreamChunk(piece, token, lp, finish, state.timings, state.stop_reason, out.num_prompt_tokens,
                           out.num_cached_tokens, state.prompt_logprobs if first else None, out.error)

    def decorate(self, lps: dict[int, Logprob] | None) -> dict[int, Logprob] | None:
        """Add each token's text to its Logprob (when a tokenizer is loaded)."""
        if lps is None or self.tokenizer is None:
            return lps
        return {t: Logprob(lp.logprob, lp.rank, self.tokenizer.decode([t], skip_special_tokens=False))
                for t, lp in lps.items()}


def per_token(out: StepOutput) -> list[StepOutput]:
    """One StepOutput per new token: a speculative step takes several, and the text layer sees them one at a
    time, so stop strings, finish and log-probs come out as they would one step each."""
    n = len(out.new_token_ids)
    if n <= 1:
        return [out]
    return [dataclasses.replace(out, new_token_ids=[t], logprobs=None if out.logprobs is None else [out.logprobs[i]],
                                finish_reason=out.finish_reason if i == n - 1 else None,
                                stop_reason=out.stop_reason if i == n - 1 else None,
                                prompt_logprobs=out.prompt_logprobs if i == 0 else None,
                                scores=out.scores if i == 0 else None)
            for i, t in enumerate(out.new_token_ids)]


def check_prompt_ids(ids: Sequence) -> list[int]:
    """A list of token ids, or a GenerationError naming what was found."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or \
            not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise GenerationError(f"prompt_token_ids should be a list of token ids, found {ids!r:.80}")
    return list(ids)
