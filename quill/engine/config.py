"""The engine core's public types: its configuration, what a step says about a request, and its stats
(``quill.engine.core`` re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass

from quill.engine.sampling import Logprob
from quill.engine.scoring import PromptScores
from quill.engine.spec_config import SpeculativeConfig
from quill.errors import GenerationError

KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """How much the engine runs at once and how much KV memory it holds."""

    max_num_seqs: int = 16  # running sequences at most
    max_num_batched_tokens: int = 256  # tokens of one step (decodes + prefill chunks)
    kv_cache_memory: int | None = None  # bytes of the KV block pool; None: a fraction of available RAM
    kv_cache_fraction: float = 0.2  # used when kv_cache_memory is None
    block_size: int = 16  # tokens per KV block
    enable_prefix_caching: bool = True
    # all-decode steps run every decoder layer in one native call when the model allows
    # (the model's native_decode_step, built by quill.layers.native_step); False keeps the Python layers
    # (the same bits, slower)
    native_step: bool = True
    # element type of the KV pools: "auto" (the default: float16, llama.cpp's default cache type),
    # "float32" (exact), "float16" or "bfloat16": a 16-bit pool takes half the memory per cached token
    # and half the bytes decode attention reads per token at long contexts; each k / v is rounded to
    # nearest even as it is stored, attention still computes in float32
    kv_cache_dtype: str = "auto"
    # speculative decoding (quill.engine.speculative); None: off
    speculative: SpeculativeConfig | None = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise GenerationError(f"EngineConfig.{name}: expected a positive integer, found {v!r}")
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory < 1):
            raise GenerationError(f"EngineConfig.kv_cache_memory: expected a positive number of bytes, "
                                  f"found {self.kv_cache_memory!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise GenerationError(f"EngineConfig.kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, "
                                  f"found {self.kv_cache_dtype!r}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise GenerationError(f"EngineConfig.speculative: expected a SpeculativeConfig, found "
                                  f"{type(self.speculative).__name__}")
        if not 0.0 < self.kv_cache_fraction <= 0.9:
            raise GenerationError(f"EngineConfig.kv_cache_fraction: expected (0, 0.9], found {self.kv_cache_fraction}")


@dataclass
class StepOutput:
    """What one step says about one request."""

    request_id: str
    new_token_ids: list[int]  # tokens sampled this step (0, 1, or more with speculative decoding)
    logprobs: list[dict[int, Logprob]] | None  # one dict per new token when params.logprobs is set
    prompt_logprobs: list[dict[int, Logprob] | None] | None  # once, with the first token, if asked
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "error" at the end
    stop_reason: int | None  # the stop token id that ended it, if any
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens taken from the prefix cache (not recomputed)
    scores: PromptScores | None = None  # once, with the first token, for a scored request
    error: str | None = None  # finish_reason "error": what failed ("ExceptionType: message")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached_free: int  # blocks holding only prefix-cache content (evictable)
    prefix_cache_queried_tokens: int  # cumulative
    prefix_cache_hit_tokens: int
    prompt_tokens_total: int  # prompt tokens computed (cache hits excluded)
    generation_tokens_total: int
    num_preemptions: int
    num_aborted: int = 0  # requests ended by their caller before they finished (cumulative)
    num_failed: int = 0  # requests ended by an error of their own in the engine (cumulative)
    prefix_caching: bool = True  # off for models with per-sequence recurrent state
    state_slots_used: int = 0  # sequences holding recurrent state (hybrid models; 0 otherwise)
    state_slots_total: int = 0
    state_bytes: int = 0  # the recurrent-state pool, out of the same budget as the KV blocks
    grammar_compiles: int = 0  # structured-output grammars compiled (a spec seen before is not; cumulative)
    spec_decode_num_drafts: int = 0  # speculative verifications that had drafts (cumulative)
    spec_decode_num_draft_tokens: int = 0  # draft tokens verified
    spec_decode_num_accepted_tokens: int = 0  # of them kept
    # sliding-window layers' block group (quill.engine.window_blocks; 0 without local layers)
    kv_local_blocks_used: int = 0
    kv_local_blocks_total: int = 0
    kv_local_window: int = 0  # the largest local window (positions)
