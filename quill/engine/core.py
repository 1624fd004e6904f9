"""The engine core: requests in, one scheduled step at a time, tokens out.

    core = EngineCore(model, eos_token_ids=[2], context_length=8192, config=EngineConfig())
    core.add_request("a", [1, 450, 7483], SamplingParams(max_tokens=8))
    while core.has_unfinished_requests():
        for out in core.step():
            ...

Single-threaded: one caller drives ``step``; ``LLM`` (offline) and the server's engine
thread (online) are such callers.  Stop *strings* are the caller's (it holds the text):
it aborts the request when one appears.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Sequence as Seq
from functools import partial

import torch
from torch import nn

from quill.engine.block_manager import BlockManager
from quill.engine.config import KV_CACHE_DTYPES, EngineConfig, EngineStats, StepOutput  # noqa: F401 (re-exported)
from quill.engine.draft import DraftModelProposer
from quill.engine.kv_cache import StepLayout
from quill.engine.limits import PromptLimits
from quill.engine.pools import build_pools
from quill.engine.sampling import SamplingParams, process_logits, sample_token, token_logprobs
from quill.engine.scheduler import Scheduler
from quill.engine.scoring import ScoreAccumulator, ScoreSpec
from quill.engine.sequence import Sequence, Status
from quill.engine.speculative import Speculator, verify, verify_token
from quill.engine.structured import GrammarCompiler, constrain
from quill.errors import GenerationError
from quill.models.base import ForwardContext

COMPILE_WAIT = 0.005  # s an idle step waits for a grammar being compiled (a caller on an event loop steps again)
LONE_FAULTS = 3  # one-request steps whose forward failed, in a row, before the engine is called broken

log = logging.getLogger("quill.engine")


class EngineCore:
    """Continuous batching over a paged KV cache with prefix caching (see the module docstring)."""

    def __init__(self, model: nn.Module, eos_token_ids: Seq[int], context_length: int,
                 config: EngineConfig | None = None, seed: int = 0, isa: str | None = None,
                 grammars: GrammarCompiler | None = None, draft: nn.Module | None = None):
        """``isa``: the native variant chosen at load (``LoadContext.native_isa``) that decode attention
        runs; None runs it in torch.  ``grammars``: compiles structured-output specs for this model's
        tokenizer (None: such requests are refused).  ``draft``: the loaded draft model when
        ``config.speculative`` is a draft_model one (its KV blocks come from the same budget)."""
        self.model, self.config = model, config or EngineConfig()
        self.eos = frozenset(eos_token_ids)
        self.context_length = context_length
        self.vocab = model.args.vocab_size
        spec = self.config.speculative
        if (spec is not None and spec.method == "draft_model") != (draft is not None):
            raise GenerationError(f"EngineCore: a draft model is given exactly when speculative_config's method is "
                                  f"draft_model; found method {spec and spec.method!r} and "
                                  f"draft {type(draft).__name__ if draft is not None else None}")
        pools = build_pools(model, self.config, context_length, isa, draft)
        self.cache, self.states, self.draft_cache = pools.cache, pools.states, pools.draft_cache
        num_blocks = pools.num_blocks
        self.draft = draft
        self.kv_cache_dtype = str(self.cache.keys[0].dtype).removeprefix("torch.")  # what the pools hold
        self.native_step, self.native_step_reason = (
            model.native_decode_step(self.cache, self.states) if self.config.native_step else (None, "disabled"))
        self.blocks = BlockManager(num_blocks, self.config.block_size,
                                   self.config.enable_prefix_caching and self.states is None, self.states,
                                   pools.window)
        if self.states is not None and self.config.enable_prefix_caching:
            # a cached block holds keys and values, not the recurrent state after it: reusing it is wrong
            log.info("prefix caching: off (the model keeps per-sequence recurrent state)")
        # what a prompt must satisfy here (checkable anywhere, e.g. by a Ray ingress that holds no model)
        self.limits = PromptLimits(self.vocab, context_length, self.config.block_size, num_blocks)
        self.speculator = self._speculator()
        self.scheduler = Scheduler(self.blocks, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   self.speculator)
        self.generator = torch.Generator().manual_seed(seed)
        self.requests: dict[str, Sequence] = {}
        self._arrivals = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_aborted = self.num_failed = 0
        self._forward_faults = 0  # steps in a row whose forward failed for every request
        self.grammars = grammars
        self._compiling: dict[str, tuple[Sequence, concurrent.futures.Future]] = {}  # queued once compiled

    def _speculator(self) -> Speculator | None:
        spec = self.config.speculative
        if spec is not None and self.states is not None:
            # a recurrent state that has seen a rejected draft cannot be undone
            log.info("speculative decoding: off (the model keeps per-sequence recurrent state)")
            return None
        if spec is None:
            return None
        proposer = None if self.draft is None else DraftModelProposer(
            self.draft, self.draft_cache, self.config.max_num_batched_tokens, self.vocab, self.eos)
        return Speculator(spec, self.context_length, proposer)

    # ---- requests --------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    label: str | None = None, score: ScoreSpec | None = None) -> None:
        """Queue a request (never blocks).  A GenerationError names what is wrong with it, calling the
        request ``label`` (default: "request <id>").  ``score`` also scores its prompt tokens
        (``StepOutput.scores`` with the first token; see quill.engine.scoring)."""
        label = label or f"request {request_id}"
        if request_id in self.requests:
            raise GenerationError(f"request id '{request_id}' is already in use")
        ids = self.check_request(prompt_token_ids, label, params)
        if score is not None:
            score.check(len(ids), self.vocab, label)
        gen = self.generator if params.seed is None else torch.Generator().manual_seed(params.seed)
        seq = Sequence(request_id, ids, params, gen, self._arrivals)
        seq.scorer = None if score is None else ScoreAccumulator(score, ids)
        seq.timings.prompt_tokens = len(ids)
        self._arrivals += 1
        self.requests[request_id] = seq
        if params.structured_outputs is not None:  # scheduled once its grammar is compiled (off the step)
            self._compiling[request_id] = (seq, self._grammar(params))
        else:
            self.scheduler.add(seq)

    def check_request(self, prompt_token_ids: Seq[int], label: str = "prompt",
                      params: SamplingParams | None = None) -> list[int]:
        """The prompt as a list, or a GenerationError naming what is wrong with it or with ``params``.

        Reads only what never changes after construction, so any thread may call it."""
        if params is not None:
            self.limits.check_params(params)
            if params.structured_outputs is not None:
                self._grammar(params)
        return self.limits.check(prompt_token_ids, label)

    def _grammar(self, params: SamplingParams) -> concurrent.futures.Future:
        """The compile of ``params``' structured-output spec (started now unless cached); a
        StructuredOutputError naming its field if the spec is invalid."""
        if self.grammars is None:
            raise GenerationError("SamplingParams.structured_outputs: this model was loaded without a tokenizer, "
                                  "which structured outputs need")
        return self.grammars.compile(params.structured_outputs)

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        """End a request now and free its blocks; unknown or finished ids are ignored (False).
        ``reason``: "abort" (its caller left; counted in ``num_aborted``) or "stop" (a stop string,
        which only the caller sees)."""
        seq = self.requests.pop(request_id, None)
        if seq is None or seq.status is Status.FINISHED:
            return False
        seq.finish_reason = reason
        if self._compiling.pop(request_id, None) is not None:  # never scheduled
            seq.status = Status.FINISHED
        else:
            self.scheduler.finish(seq)
        self.num_aborted += reason == "abort"
        return True

    def fail_request(self, request_id: str) -> None:
        """The caller failed on this request (e.g. making its text): end it if it runs, count it failed."""
        self.abort_request(request_id, "error")
        self.num_failed += 1

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._compiling)

    def stats(self) -> EngineStats:
        b, s, st = self.blocks, self.scheduler, self.states
        waiting = len(s.waiting) + len(self._compiling)  # a request whose grammar compiles waits too
        return EngineStats(len(s.running), waiting, b.num_used, b.num_blocks, b.num_cached_free,
                           b.queried_tokens, b.hit_tokens, self.prompt_tokens_total, self.generation_tokens_total,
                           s.num_preemptions, self.num_aborted, self.num_failed, b.prefix_caching,
                           st.num_used if st else 0, st.num_slots if st else 0, st.nbytes() if st else 0,
                           self.grammars.compiles if self.grammars else 0, *self._spec_counts(),
                           *self._window_counts())

    def _window_counts(self) -> tuple[int, int, int]:
        w = self.blocks.window
        return (w.num_used, w.num_blocks, w.window) if w is not None else (0, 0, 0)

    def _spec_counts(self) -> tuple[int, int, int]:
        c = self.speculator.counters if self.speculator is not None else None
        return (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) if c else (0, 0, 0)

    # ---- one step -----------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Admit, run one packed forward (prefill chunks and decodes), sample, retire.

        An exception that concerns one request (its sampling, log-probs, scores, or a forward that
        fails only with it in the batch) ends that request alone with finish reason "error" and the
        error in ``StepOutput.error``; one that cannot be pinned on a request is raised."""
        outputs = self._compiled()
        batch = self.scheduler.schedule()
        if not batch:
            return outputs + self._unschedulable()
        scored = {seq: seq.scorer.positions(seq.num_computed, n) for seq, n in batch
                  if seq.scorer is not None and not seq.scorer.done()}  # prompt positions scored this step
        started, decoding = time.perf_counter(), self._decodes_only(batch)
        prompted = [] if self.speculator is None else [  # prompts this step finishes (a draft model reads them)
            seq for seq, n in batch if n > 1 and not seq.drafts and seq.num_computed + n == seq.num_tokens]
        try:
            groups = [(batch, *self._forward(batch, scored))]
            self._forward_faults = 0
        except Exception as e:  # find the request it belongs to, if any (a cold path)
            groups = self._forward_apart(batch, scored, e, outputs)
        for part, logits, rows in groups:
            # the rows tokens are taken from: the last, or with drafts all k + 1 (logit_bias applies to each)
            sampled = [(seq, r) for seq, n in part if seq.num_computed + n >= seq.num_tokens
                       for r in rows[seq][-1 - len(seq.drafts):]]
            constrain(logits, sampled, self.grammars)  # grammar bitmasks and logit_bias, before sampling
            for seq, n in part:
                try:  # free in CPython 3.11 unless it raises
                    out = self._advance(seq, n, logits, rows[seq], scored.get(seq))
                except Exception as e:
                    out = self._failed(seq, e)
                if out is not None:
                    outputs.append(out)
        if decoding:  # what a step of this many rows costs, for speculation's plan (quill.engine.spec_cost)
            self.speculator.step_times.record(sum(n for _, n in batch), time.perf_counter() - started)
        elif prompted:  # a draft model reads the prompts that just finished
            self.speculator.prefill([seq for seq in prompted if seq.status is Status.RUNNING and seq.output],
                                    len(self.scheduler.running))
        return outputs

    def _decodes_only(self, batch: list[tuple[Sequence, int]]) -> bool:
        """Whether speculation is on and every sequence in ``batch`` decodes (its token and drafts, no prompt)."""
        return self.speculator is not None and all(
            n == 1 + len(seq.drafts) and seq.num_computed + 1 == seq.num_tokens for seq, n in batch)

    def _compiled(self) -> list[StepOutput]:
        """Queue the requests whose grammar is compiled; end those whose compile failed.  With nothing else
        to run, wait a little for a compile rather than spin."""
        if not self._compiling:
            return []
        if not self.scheduler.has_unfinished():
            concurrent.futures.wait([f for _, f in self._compiling.values()], COMPILE_WAIT,
                                    concurrent.futures.FIRST_COMPLETED)
        outputs = []
        for rid, (seq, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[rid]
            try:
                seq.grammar = self.grammars.matcher(future.result())
            except Exception as e:  # its compile (or matcher) failed: this request alone ends
                log.error("request %s: its grammar failed to compile", rid, exc_info=e)
                seq.status, seq.finish_reason = Status.FINISHED, "error"
                self.requests.pop(rid, None)
                self.num_failed += 1
                outputs.append(StepOutput(rid, [], None, None, "error", None, len(seq.prompt), 0,
                                          error=f"{seq.params.structured_outputs.source}: the grammar failed to "
                                                f"compile: {type(e).__name__}: {e}"))
                continue
            self.scheduler.add(seq)
        return outputs

    def _advance(self, seq: Sequence, n: int, logits: torch.Tensor, rows: list[int],
                 pos: range | None) -> StepOutput | None:
        """``seq``'s ``n`` tokens were computed: its scores and prompt log-probs, and its next token once
        its prompt is done (with drafts: the tokens verification keeps, quill.engine.speculative)."""
        if seq.drafts:
            return verify(self.speculator, seq, logits, rows, self._sample, self.blocks)
        if pos is not None:
            skip = pos.start - seq.num_computed if seq.wants_prompt_logprobs else 0  # all rows picked
            seq.scorer.add(logits[rows[skip:skip + len(pos)]], pos)
        prompt_chunk = seq.in_prefill
        seq.num_computed += n
        if prompt_chunk and not seq.output:
            self.prompt_tokens_total += n
        self.blocks.register_computed(seq)
        if seq.wants_prompt_logprobs:
            self._prompt_logprobs(seq, logits, rows)
        if seq.num_computed == seq.num_tokens:
            return self._sample(seq, logits[rows[-1]])
        return None

    def _forward_apart(self, batch: list[tuple[Sequence, int]], scored: dict[Sequence, range],
                       error: Exception, outputs: list[StepOutput]) -> list:
        """The batch's forward raised ``error``: run each request's piece alone (rewriting the same KV
        slots).  Those that fail alone end with "error" (added to ``outputs``); the rest go on.  When
        none runs alone the fault is the engine's, and ``error`` is raised -- also for a batch of one
        after ``LONE_FAULTS`` such steps in a row (one request cannot be told from a broken engine)."""
        groups, failing = [], []
        for seq, n in batch:
            part = [(seq, n)]
            try:
                groups.append((part, *self._forward(part, {seq: scored[seq]} if seq in scored else {})))
            except Exception as e:
                failing.append((seq, e))
        self._forward_faults = 0 if groups else self._forward_faults + 1
        if not groups and (len(batch) > 1 or self._forward_faults >= LONE_FAULTS):
            raise error
        for seq, e in failing:
            outputs.append(self._failed(seq, e))
        return groups

    def _failed(self, seq: Sequence, error: Exception) -> StepOutput:
        """End ``seq`` because of ``error`` (its blocks are freed); logged with the traceback."""
        log.error("request %s failed in the engine; the other requests go on", seq.request_id, exc_info=error)
        seq.finish_reason = "error"
        self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)
        self.num_failed += 1
        return StepOutput(seq.request_id, [], None, None, "error", None, len(seq.prompt), seq.num_cached,
                          error=f"{type(error).__name__}: {error}")

    def _forward(self, batch: list[tuple[Sequence, int]], scored: dict[Sequence, range]) -> tuple[torch.Tensor, dict]:
        tokens, positions, pieces, local, want, rows = [], [], [], [], [], {}
        for seq, n in batch:
            start = len(tokens)
            tokens += seq.tokens[seq.num_computed:seq.num_computed + n - len(seq.drafts)] + seq.drafts
            positions += range(seq.num_computed, seq.num_computed + n)
            pieces.append((seq.block_table, seq.num_computed, n, len(seq.prompt)))
            local.append((seq.window_table, seq.num_computed, n, len(seq.prompt)))
            picked = range(start, start + n) if seq.wants_prompt_logprobs or seq.drafts else (
                [start + n - 1] if seq.num_computed + n == seq.num_tokens else [])
            if seq in scored:  # scored rows come before the sampled one
                picked = sorted({*picked, *(start + p - seq.num_computed for p in scored[seq])})
            rows[seq] = list(range(len(want), len(want) + len(picked)))
            want += picked
        layout = StepLayout.build(pieces, self.blocks.block_size)
        if self.blocks.window is not None:  # the sliding-window layers' tables: the same positions, their group's rows
            layout.local = StepLayout.build(local, self.blocks.block_size)
        if self.native_step is not None and (layout.one_row_per_sequence(len(batch)) or (
                self.states is None and layout.all_decodes())):  # every token a decode
            # recurrent layers: each sequence's state slot (one row per sequence, in the batch's order)
            state_rows = None if self.states is None else torch.tensor([seq.state_slot for seq, _ in batch])
            ctx = ForwardContext(torch.tensor([positions]), None, None, torch.tensor(want, dtype=torch.int64),
                                 layers=partial(self.native_step, layout, state_rows=state_rows))
        else:
            caches = self.cache.views(layout)
            if self.states is not None:  # recurrent layers: each sequence's state slot and piece of the row
                segments = [(p, n) for p, (_, n) in zip(_starts(batch), batch)]
                caches = self.states.views(caches, [seq.state_slot for seq, _ in batch], segments)
            ctx = ForwardContext(torch.tensor([positions]), None, caches,
                                 logits_indices=torch.tensor(want, dtype=torch.int64))
        try:
            logits = self.model(torch.tensor([tokens]), ctx)[0]  # [N, V] float32
        except BaseException:
            if self.states is not None:
                self.states.discard()  # a retried request starts again from the states it had
            raise
        if self.states is not None:
            self.states.commit()
        return logits, rows

    def _prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, rows: list[int]) -> None:
        """Accumulate prompt log-probs chunk by chunk; position i predicts token i + 1."""
        if seq.prompt_acc is None:
            seq.prompt_acc = [None]  # position 0 has no log-prob
        acc = seq.prompt_acc
        first = len(acc) - 1  # prompt position of this chunk's first row
        lps = torch.log_softmax(logits[rows], -1)
        for j in range(lps.shape[0]):
            pos = first + j
            if pos + 1 < len(seq.prompt):
                acc.append(token_logprobs(lps[j], seq.prompt[pos + 1], seq.params.prompt_logprobs))
        if seq.num_computed >= len(seq.prompt):
            seq.prompt_logprobs = acc

    def _sample(self, seq: Sequence, logits: torch.Tensor, draft: int | None = None) -> StepOutput:
        """The next token from ``logits`` [V] (with a ``draft``: kept or replaced by speculative verification)."""
        p = seq.params
        processed = process_logits(logits, p, seq.prompt, seq.output, self.eos)
        if seq.grammar is not None and not torch.isfinite(processed).any():
            processed = logits  # min_tokens banned EOS where the grammar allows nothing else: the grammar wins
        token = (sample_token(processed, p, torch.empty(0, dtype=torch.int64), seq.generator) if draft is None
                 else verify_token(processed, p, draft, seq.generator))
        if seq.grammar is not None:
            seq.grammar.accept(token)
        lp = [token_logprobs(torch.log_softmax(logits, -1), token, p.logprobs)] if p.logprobs is not None else None
        seq.output.append(token)
        self.generation_tokens_total += 1
        now = time.perf_counter()
        if seq.last_token_at is None:
            seq.timings.prefill_s = now - seq.started
        else:
            seq.timings.decode_s += now - seq.last_token_at
        seq.last_token_at = now
        seq.timings.generated_tokens = len(seq.output)
        self._check_finished(seq, token)
        first = len(seq.output) == 1
        scores = seq.scorer.result() if first and seq.scorer is not None else None
        out = StepOutput(seq.request_id, [token], lp, seq.prompt_logprobs if first else None, seq.finish_reason,
                         seq.stop_reason, len(seq.prompt), seq.num_cached, scores)
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
            self.requests.pop(seq.request_id, None)
        return out

    def _check_finished(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if seq.grammar is not None and seq.grammar.terminated:  # its stop token (EOS) ended the grammar
            seq.finish_reason = "stop"
        elif token in p.stop_token_ids and len(seq.output) >= p.min_tokens:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif token in self.eos and not p.ignore_eos and len(seq.output) >= p.min_tokens:
            seq.finish_reason = "stop"
        elif (p.max_tokens is not None and len(seq.output) >= p.max_tokens) or seq.num_tokens >= self.context_length:
            seq.finish_reason = "length"

    def _unschedulable(self) -> list[StepOutput]:
        """Nothing ran although requests wait: the first one can never fit the KV pool; end it ("length")."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        seq = self.scheduler.waiting[0]
        seq.finish_reason = "length"
        self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)
        return [StepOutput(seq.request_id, [], None, None, "length", None, len(seq.prompt), 0)]


def _starts(batch: list[tuple[Sequence, int]]) -> list[int]:
    """Where each scheduled sequence's tokens start in the step's packed row."""
    starts, at = [], 0
    for _, n in batch:
        starts.append(at)
        at += n
    return starts
