"""Prometheus metrics of a server, in a registry of its own (no process-wide state).

Engine state (running / waiting requests, KV blocks, prefix-cache and token counters) is
read at scrape time from the engine's last step snapshot; latencies are observed by the
engine thread as tokens come out.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from quill.engine.core import EngineStats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


# (metric name, EngineStats field, description): the engine's state, exported by quill serve at scrape
# time and by each Ray replica (quill.serving.ray.EngineGauges).
ENGINE_GAUGES = (
    ("quill_num_requests_running", "num_running", "Requests in the running batch"),
    ("quill_num_requests_waiting", "num_waiting", "Requests waiting to be admitted"),
    ("quill_kv_cache_blocks_used", "kv_blocks_used", "KV blocks held by running requests"),
    ("quill_kv_cache_blocks_total", "kv_blocks_total", "KV blocks in the pool"),
    ("quill_kv_cache_blocks_cached", "kv_blocks_cached_free", "Free KV blocks still holding prefix-cache content"),
    ("quill_kv_cache_local_blocks_used", "kv_local_blocks_used", "KV blocks of sliding-window layers held by running "
     "requests (their own block group, freed as the window slides; 0: no such layers)"),
    ("quill_kv_cache_local_blocks_total", "kv_local_blocks_total", "KV blocks in the sliding-window layers' pool"),
    ("quill_prefix_caching_enabled", "prefix_caching", "1 when prefix caching is on (off for models with "
     "per-sequence recurrent state)"),
    ("quill_recurrent_state_slots_used", "state_slots_used", "Sequences holding recurrent state (hybrid models)"),
    ("quill_recurrent_state_slots_total", "state_slots_total", "Recurrent-state slots (max_num_seqs; 0: no state)"),
    ("quill_recurrent_state_bytes", "state_bytes", "Bytes of the recurrent-state pool (from the KV budget)"),
)
ENGINE_COUNTERS = (
    ("quill_prefix_cache_queried_tokens", "prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache"),
    ("quill_prefix_cache_hit_tokens", "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"),
    ("quill_prompt_tokens", "prompt_tokens_total", "Prompt tokens computed (cache hits excluded)"),
    ("quill_generation_tokens", "generation_tokens_total", "Tokens generated"),
    ("quill_num_preemptions", "num_preemptions", "Requests preempted (blocks freed, recomputed later)"),
    ("quill_requests_aborted", "num_aborted", "Requests ended before they finished because their client left"),
    ("quill_requests_failed", "num_failed", "Requests ended by an error of their own (the engine went on)"),
    ("quill_grammar_compiles", "grammar_compiles", "Structured-output grammars compiled (a spec seen before is not)"),
)

# speculative decoding, under vLLM's names (its v1 counters; the acceptance rate is its v0 gauge), so dashboards
# made for vLLM read them; exported by quill serve (0 while speculation is off)
SPEC_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "spec_decode_num_drafts", "Verification steps that had draft tokens"),
    ("vllm:spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens proposed and verified"),
    ("vllm:spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens accepted"),
)


def spec_gauges(s: EngineStats) -> tuple[tuple[str, float, str], ...]:
    """Acceptance rate (accepted / drafted) and mean acceptance length (tokens a verification step emits:
    1 + accepted / drafts, vLLM's definition in its logs)."""
    rate = s.spec_decode_num_accepted_tokens / s.spec_decode_num_draft_tokens if s.spec_decode_num_draft_tokens else 0.0
    mean = 1.0 + s.spec_decode_num_accepted_tokens / s.spec_decode_num_drafts if s.spec_decode_num_drafts else 0.0
    return (("vllm:spec_decode_draft_acceptance_rate", rate, "Accepted draft tokens / draft tokens"),
            ("quill_spec_decode_mean_acceptance_length", mean,
             "Tokens emitted per verification step with drafts (1 + accepted / drafts)"))


class _EngineCollector:
    """Gauges and counters read from ``stats()`` on every scrape."""

    def __init__(self, stats: Callable[[], EngineStats], model: str):
        self.stats, self.model = stats, model

    def collect(self):
        s = self.stats()
        for table, family in ((ENGINE_GAUGES, GaugeMetricFamily), (ENGINE_COUNTERS, CounterMetricFamily)):
            for name, field, doc in table:
                m = family(name, doc, labels=["model_name"])
                m.add_metric([self.model], getattr(s, field))
                yield m
        for name, field, doc in SPEC_COUNTERS:
            m = CounterMetricFamily(name, doc, labels=["model_name"])
            m.add_metric([self.model], getattr(s, field))
            yield m
        for name, value, doc in spec_gauges(s):
            m = GaugeMetricFamily(name, doc, labels=["model_name"])
            m.add_metric([self.model], value)
            yield m


class ServerMetrics:
    """Everything ``GET /metrics`` reports."""

    def __init__(self, stats: Callable[[], EngineStats] | None, model: str):
        """``stats``: the engine's counters, read at scrape time; None for a host without an engine
        of its own (the Ray ingress, whose replicas hold the engines)."""
        self.registry = CollectorRegistry()
        self.model = model
        if stats is not None:
            self.registry.register(_EngineCollector(stats, model))
        self.ttft = Histogram("quill_time_to_first_token_seconds", "From request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("quill_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("quill_e2e_request_latency_seconds", "From request arrival to its last token",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter("quill_requests_finished", "Requests ended, by finish reason (stop, length; "
                                "abort: the client left; error: a fault of the request's own)",
                                ["finish_reason"], registry=self.registry)

    def finished(self, reason: str, seconds: float) -> None:
        self.requests.labels(reason).inc()
        self.e2e.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
