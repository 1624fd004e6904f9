"""What a prompt and its sampling parameters are checked against before a request is queued."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from quill.engine.sampling import SamplingParams
from quill.errors import GenerationError


@dataclass(frozen=True)
class PromptLimits:
    """The facts a prompt is checked against: vocabulary, context window and KV pool size."""

    vocab: int
    context_length: int
    block_size: int
    num_blocks: int

    def check(self, prompt_token_ids: Seq[int], label: str = "prompt") -> list[int]:
        """The prompt as a list, or a GenerationError naming what is wrong with it."""
        ids = list(prompt_token_ids)
        if not ids:
            raise GenerationError(f"{label} is empty")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab]
        if bad:
            raise GenerationError(f"{label}: token id {bad[0]!r} is outside the vocabulary [0, {self.vocab})")
        if len(ids) > self.context_length:
            raise GenerationError(f"{label} has {len(ids)} tokens, longer than the context window of "
                                  f"{self.context_length} tokens")
        if -(-(len(ids) + 1) // self.block_size) > self.num_blocks:
            raise GenerationError(f"{label} has {len(ids)} tokens, more than the KV cache holds "
                                  f"({self.num_blocks * self.block_size} tokens)")
        return ids

    def check_params(self, params: SamplingParams) -> None:
        """A GenerationError naming the field if ``params`` refer to token ids outside the vocabulary
        (``SamplingParams`` checks everything that does not depend on the model itself)."""
        bad = [t for t in params.stop_token_ids if t >= self.vocab]
        if bad:
            raise GenerationError(f"SamplingParams.stop_token_ids: token id {bad[0]} is outside the vocabulary "
                                  f"[0, {self.vocab})")
        bad = [t for t in params.logit_bias or () if t >= self.vocab]
        if bad:
            raise GenerationError(f"SamplingParams.logit_bias: token id {bad[0]} is outside the vocabulary "
                                  f"[0, {self.vocab})")
