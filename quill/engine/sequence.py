"""One request inside the engine: its tokens, how far its KV is computed, its blocks, its sampler state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from quill.engine.sampling import Logprob, SamplingParams
from quill.engine.scoring import ScoreAccumulator


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Timings:
    """Where the time of one request went (seconds, wall clock)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0  # from admission to the first token
    decode_s: float = 0.0  # every later token

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        n = self.generated_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s else 0.0


@dataclass(eq=False)
class Sequence:
    """A request's state.  ``num_computed`` tokens of ``tokens`` have their KV in ``block_table``."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    arrival: int  # admission order (preemption takes the newest)
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    # prompt tokens taken from the prefix cache at the first admission (what usage reports; a recompute after
    # preemption hits blocks the request wrote itself, its output's among them)
    num_cached: int = 0
    admitted: bool = False
    block_table: list[int] = field(default_factory=list)
    num_hashed: int = 0  # leading full blocks registered in the prefix cache
    # the sliding-window block group's table (models with local layers, quill.engine.window_blocks): logical
    # blocks as block_table's, NULL (0) before the window; and how many leading entries were given back
    window_table: list[int] = field(default_factory=list)
    window_freed: int = 0
    state_slot: int | None = None  # its recurrent state's slot (models with recurrent layers), while running
    finish_reason: str | None = None
    stop_reason: int | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_acc: list[dict[int, Logprob] | None] | None = None  # prompt log-probs so far (chunked prefill)
    scorer: ScoreAccumulator | None = None  # a scored prompt's rows so far (quill.engine.scoring)
    # structured outputs: the grammar's matcher (quill.engine.structured.GrammarState), once compiled; it has
    # seen exactly ``output``, which a preemption keeps, so it is never rolled back
    grammar: Any = None
    # speculative decoding (quill.engine.speculative): tokens proposed to follow ``tokens``, run with the last
    # one this step (positions num_tokens ..), and the sequence's adaptive state (SpecState)
    drafts: list[int] = field(default_factory=list)
    spec: Any = None
    timings: Timings = field(default_factory=Timings)
    started: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def in_prefill(self) -> bool:
        """More than one token still to compute (a prompt, or a recompute after preemption)."""
        return self.num_tokens - self.num_computed > 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None and not self.output

    @property
    def cacheable_tokens(self) -> int:
        """How many leading tokens may come from the prefix cache (positions that need logits may not)."""
        if self.params.prompt_logprobs is not None:
            return 0
        if self.scorer is not None:
            return min(self.scorer.spec.first - 1, self.num_tokens - 1)
        return self.num_tokens - 1

    def restart(self) -> None:
        """Back to waiting with nothing computed (preempted): what the prompt's rows gave so far is dropped."""
        self.status, self.num_computed = Status.WAITING, 0
        self.drafts = []
        if self.prompt_logprobs is None:
            self.prompt_acc = None  # rebuilt from position 0 (a scorer instead skips what it already holds)
