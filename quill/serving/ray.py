"""quill on Ray Serve: replicas that each hold one engine, behind one OpenAI-compatible ingress.

    quill serve --replicas 2 --threads-per-replica 1                 # a Ray cluster of this machine
    quill serve --replicas 4 --ray-address auto                      # the cluster `ray start` made
    quill serve --min-replicas 1 --max-replicas 8 --ray-address auto # autoscaled by queue length
    serve run quill.serving.ray:build_app model=path/model.gguf replicas=2

Two deployments: ``QuillReplica`` (one ``LLM`` and its ``AsyncEngine`` per replica, its own
process and ``threads_per_replica`` CPUs) and ``QuillIngress`` (no model: the tokenizer and
prompt limits it gets from a replica, and the very ``OpenAIServing`` and FastAPI routes of
``quill serve`` over a ``RemoteEngine``).  Calls go from the ingress to a replica through
``quill.serving.router.AffinityRouter`` (a chat stays on the replica holding its prefix cache
while that replica is not much busier than the least-loaded one) and stream back token by token.

Faults: Ray restarts a replica whose process dies or whose engine thread has stopped
(``check_health``); a request on it is sent again once if no token had reached the client,
otherwise it ends with a 503 (an error event in a stream).  Ray is an optional extra
(``pip install 'quill[ray]'``); only this path imports it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import random
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from quill.engine.core import EngineConfig, PromptLimits
from quill.errors import ConfigError, QuillError
from quill.options import RunOptions
from quill.serving.app import build_app as build_http_app
from quill.serving.app import default_model_name
from quill.serving.engine import AsyncEngine, EngineStopped, ServerBusy
from quill.serving.metrics import ENGINE_COUNTERS, ENGINE_GAUGES, SPEC_COUNTERS, ServerMetrics
from quill.serving.openai import OpenAIServing
from quill.serving.remote import RemoteEngine, ReplicaMetrics
from quill.serving.router import AffinityRouter

APP_NAME = "quill"
log = logging.getLogger("quill.serving")


@dataclass(frozen=True)
class RayServeOptions:
    """Everything the Ray application is built from (sent to every replica as is)."""

    model: str | None = None  # checkpoint path, .gguf file or Hub id; None: the default model
    replicas: int | None = 2  # a fixed count; None: autoscale between min_replicas and max_replicas
    min_replicas: int = 1
    max_replicas: int = 2
    target_ongoing_requests: int | None = None  # autoscaling's aim per replica (default: max_num_seqs)
    autoscaling: dict = field(default_factory=dict)  # more of Ray's AutoscalingConfig: upscale_delay_s, ...
    threads_per_replica: int = 1  # CPUs each replica reserves from Ray and runs its kernels on
    ingress_replicas: int = 1  # ingress processes (no model; ~1.3 ms CPU per streamed token each, measured)
    llm: dict = field(default_factory=dict)  # quill.options.RunOptions fields (= quill.LLM keywords), as asdict
    engine: dict = field(default_factory=dict)  # EngineConfig fields
    model_name: str | None = None  # the name clients use (default: the checkpoint's)
    api_key: str | None = None
    max_waiting: int = 256  # per replica, beyond its running batch; the router queues as many more
    imbalance: int = 4  # queue-length lead past which a chat leaves its home replica
    stream_interval: int = 1  # tokens a streamed request gathers in its replica before they are sent
    shutdown_timeout: float = 30.0  # seconds a stopping replica lets running requests finish
    tool_call_parser: str = "auto"  # quill.serving.tool_parsers name; auto: the model family's (the ingress runs it)
    reasoning_parser: str = "auto"  # quill.serving.reasoning name, or none; auto: from the chat template

    def __post_init__(self):
        for name in ("min_replicas", "max_replicas", "threads_per_replica", "ingress_replicas", "max_waiting",
                     "imbalance", "stream_interval"):
            _check_int(name, getattr(self, name), 0 if name in ("max_waiting", "imbalance") else 1)
        if self.replicas is not None:
            _check_int("replicas", self.replicas, 1)
        elif self.min_replicas > self.max_replicas:
            raise ConfigError(f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})")
        if self.target_ongoing_requests is not None:
            _check_int("target_ongoing_requests", self.target_ongoing_requests, 1)
        EngineConfig(**self.engine)  # its own checks, here rather than on every replica
        _check_parsers(self.tool_call_parser, self.reasoning_parser)  # here, not in the ingress's start-up
        run = RunOptions.from_mapping(self.llm, "RayServeOptions.llm")  # likewise; every field, by name
        if run.threads is not None:
            raise ConfigError(f"llm threads={run.threads}: each replica runs threads_per_replica threads; set that")
        object.__setattr__(self, "llm", run.llm_kwargs())
        if self.replicas is None:
            _ = self.autoscaling_config  # Ray's own checks, with the field named
        elif self.autoscaling:
            raise ConfigError("autoscaling settings need min/max replicas instead of a fixed replica count")

    @property
    def autoscaling_config(self) -> dict:
        """Ray Serve's AutoscalingConfig (checked): replicas scale by ongoing requests per replica."""
        from pydantic import ValidationError
        from ray.serve.config import AutoscalingConfig
        config = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                  "target_ongoing_requests": self.target_ongoing_requests or EngineConfig(**self.engine).max_num_seqs,
                  **self.autoscaling}
        try:
            AutoscalingConfig(**config)
        except (ValidationError, TypeError, ValueError) as e:
            raise ConfigError(f"autoscaling config {config}: {e}") from None
        return config

    @property
    def engine_config(self) -> EngineConfig:
        """Each replica's; without a KV size given, the replicas share the one engine's default
        fraction of free RAM (0.2 / replicas each), as they may all share one machine."""
        engine = dict(self.engine)
        if engine.get("kv_cache_memory") is None and "kv_cache_fraction" not in engine:
            engine["kv_cache_fraction"] = EngineConfig.kv_cache_fraction / (self.replicas or self.max_replicas)
        return EngineConfig(**engine)

    @property
    def replica_llm_kwargs(self) -> dict:
        """What each replica's ``quill.LLM`` gets besides the model and engine config: the RunOptions, its threads."""
        return {**self.llm, "threads": self.threads_per_replica}

    @property
    def cpus_needed(self) -> int:
        return (self.replicas or self.min_replicas) * self.threads_per_replica


def _check_parsers(tool_call_parser: str, reasoning_parser: str) -> None:
    from quill.serving.reasoning import PARSERS as REASONING
    from quill.serving.tool_parsers import PARSERS as TOOLS
    if tool_call_parser not in ("auto", *TOOLS):
        raise ConfigError(f"tool_call_parser: unknown parser '{tool_call_parser}'; known: auto, {', '.join(TOOLS)}")
    if reasoning_parser not in ("auto", "none", *REASONING):
        raise ConfigError(f"reasoning_parser: unknown parser '{reasoning_parser}'; known: auto, none, "
                          f"{', '.join(REASONING)}")


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name}: expected an integer >= {low}, found {value!r}")


# ---- the replica --------------------------------------------------------------------------------------
class QuillReplica:
    """One quill engine in one Ray Serve replica process."""

    def __init__(self, options: RayServeOptions):
        from quill.engine.llm import LLM

        # Loaded on the thread that will step it: libgomp keeps one worker pool per thread (see AsyncEngine).
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="quill-engine")
        self.llm = self._executor.submit(lambda: LLM(options.model, engine_config=options.engine_config,
                                                     progress=False, **options.replica_llm_kwargs)).result()
        self.engine = AsyncEngine(self.llm, options.max_waiting, executor=self._executor,
                                  stream_interval=options.stream_interval)
        self.engine.start()
        self.who = {"replica": serve.get_replica_context().replica_id.unique_id, "pid": os.getpid(),
                    "node": ray.get_runtime_context().get_node_id()[:12]}
        self._gauges = EngineGauges(self.engine, self.who["replica"])

    def describe(self) -> dict:
        """What the ingress needs to serve this model without loading it."""
        tok = self.llm.tokenizer
        return {"limits": dataclasses.asdict(self.llm.engine.limits), "context_length": self.llm.context_length,
                "model_name": default_model_name(self.llm.path),
                "tokenizer": None if tok is None else spec_to_dict(tok.spec), "arithmetic": self.llm.arithmetic,
                **self.who}

    async def generate(self, requests: list, affinity: str | None = None, streamed: bool = True):
        """("replica", who) once it is queued (or ("busy" | "stopped" | "invalid", why)), then ("chunks",
        [(index, chunk), ...]) -- the chunks the engine handed over together, one Ray item; a request that
        failed on its own ends with an "error" chunk -- (or a last ("stopped" | "invalid", why)).

        ``affinity`` was read by the router already; ``streamed=False``: nothing is sent before the end
        (AsyncEngine.submit).  Cancelling the call aborts the requests."""
        try:
            handle = self.engine.submit(requests, streamed=streamed)
        except ServerBusy as e:
            yield ("busy", str(e))
            return
        except EngineStopped as e:
            yield ("stopped", str(e))
            return
        except QuillError as e:  # more requests than this replica ever holds (a 400, never retried)
            yield ("invalid", str(e))
            return
        try:
            yield ("replica", self.who)
            async for item in handle:
                batch, error = [item], None
                while handle.pending and handle.ready():  # each Ray item costs the ingress ~1 ms of CPU
                    try:
                        batch.append(await handle.__anext__())
                    except QuillError as e:  # after the chunks before it
                        error = e
                        break
                yield ("chunks", batch)
                if error is not None:
                    raise error
        except EngineStopped as e:
            yield ("stopped", str(e))
        except QuillError as e:  # the engine refused a request the ingress let through (a smaller KV pool)
            yield ("invalid", str(e))
        finally:
            handle.close()

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising gets the replica replaced."""
        if not self.engine.alive:
            raise RuntimeError(f"the quill engine has stopped: {self.engine.error}")

    def __del__(self):
        gauges = getattr(self, "_gauges", None)
        if gauges is not None:
            gauges.stop()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(5.0)
            self._executor.shutdown(wait=False, cancel_futures=True)


class EngineGauges:
    """The engine's state as Ray metrics, refreshed every second from a thread: each node's metrics agent
    exports them (``ray start --metrics-export-port P``: ``ray_quill_num_requests_running{replica=...}``...),
    speculative decoding's counters under vLLM's names too (``ray_vllm_spec_decode_num_drafts``...)."""

    def __init__(self, engine: AsyncEngine, replica: str, period: float = 1.0):
        from ray.util.metrics import Gauge
        self.engine, self.tags, self.period = engine, {"replica": replica}, period
        # counters are exported as gauges of their running totals (Ray's Counter wants increments)
        # (vLLM's ``vllm:spec_decode_*`` leave as ``vllm_spec_decode_*``: no colon name reached Ray's exporter)
        self.gauges = {field: Gauge(name.replace(":", "_"), description=doc, tag_keys=("replica",))
                       for name, field, doc in ENGINE_GAUGES + ENGINE_COUNTERS + SPEC_COUNTERS}
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="quill-ray-metrics", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            stats = self.engine.stats()
            for f, gauge in self.gauges.items():
                gauge.set(float(getattr(stats, f)), tags=self.tags)

    def stop(self) -> None:
        self._stop.set()


def spec_to_dict(spec) -> dict:
    """A TokenizerSpec as plain data (the tokenizer as its JSON) to send to the ingress."""
    d = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    d["tokenizer"] = spec.tokenizer.to_str()
    return d


def spec_from_dict(d: dict):
    from tokenizers import Tokenizer as HFTokenizer

    from quill.tokenizer_spec import TokenizerSpec
    return TokenizerSpec(**{**d, "tokenizer": HFTokenizer.from_str(d["tokenizer"])})


# ---- the ingress -------------------------------------------------------------------------------------
@serve.ingress()
class QuillIngress:
    """The OpenAI routes of ``quill serve`` over the replicas (holds no model)."""

    async def __init__(self, replicas, options: RayServeOptions):
        from quill.tokenizer import Tokenizer

        about = await replicas.describe.remote()
        tokenizer = None if about["tokenizer"] is None else Tokenizer(spec_from_dict(about["tokenizer"]))
        name = options.model_name or about["model_name"]
        self.metrics = ServerMetrics(None, name)
        self.engine = RemoteEngine(replicas, PromptLimits(**about["limits"]), ReplicaMetrics(self.metrics))
        self.serving = OpenAIServing(self.engine, tokenizer, name, about["context_length"],
                                     tool_call_parser=options.tool_call_parser,
                                     reasoning_parser=options.reasoning_parser)
        self.api_key = options.api_key
        self.arithmetic = about["arithmetic"]

    def model_name(self) -> str:
        return self.serving.model_name

    def load_line(self) -> str:
        """Which arithmetic the replicas run and why: the line ``quill serve`` prints for one process."""
        return "quill: " + "; ".join(f"{k}: {v}" for k, v in self.arithmetic.items())

    def __serve_build_asgi_app__(self):
        return build_http_app(self.serving, self.metrics, self.api_key)


def application(options: RayServeOptions):
    """The Ray Serve application: the ingress bound to the replicas."""
    capacity = options.engine_config.max_num_seqs + options.max_waiting
    if options.replicas is not None:
        scaling = {"num_replicas": options.replicas}
    else:
        scaling = {"autoscaling_config": options.autoscaling_config}
    replica = serve.deployment(QuillReplica).options(
        name="QuillReplica", ray_actor_options={"num_cpus": options.threads_per_replica},
        max_ongoing_requests=capacity, max_queued_requests=options.max_waiting,
        request_router_config=RequestRouterConfig(request_router_class=AffinityRouter,
                                                  request_router_kwargs={"imbalance": options.imbalance}),
        health_check_period_s=5, graceful_shutdown_timeout_s=options.shutdown_timeout, **scaling)
    ingress = serve.deployment(QuillIngress).options(
        name="QuillIngress", num_replicas=options.ingress_replicas, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000)
    return ingress.bind(replica.bind(options), options)


_INTS = {"replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "threads_per_replica",
         "ingress_replicas", "max_waiting", "imbalance", "stream_interval", "max_num_seqs", "max_num_batched_tokens",
         "kv_cache_memory"}
_LLM = {f.name for f in dataclasses.fields(RunOptions)} - {"threads"}  # threads: threads_per_replica
_ENGINE = {f.name for f in dataclasses.fields(EngineConfig)}


def build_app(args: dict):
    """``serve run quill.serving.ray:build_app model=... replicas=2 threads_per_replica=1 ...``
    (the keys: ``build_options``)."""
    return application(build_options(args))


def build_options(args: dict) -> RayServeOptions:
    """``build_app``'s arguments as the options of the application.

    Keys: RayServeOptions' fields, quill.options.RunOptions' fields (quill.LLM's keywords: dtype,
    activation_quant, kv_cache_dtype, isa, cache, ...; not threads: threads_per_replica) and EngineConfig's
    other fields (max_num_seqs, kv_cache_memory, ...); values may be strings."""
    own = {f.name for f in dataclasses.fields(RayServeOptions)} - {"llm", "engine", "autoscaling"}
    top, llm, engine = {}, {}, {}
    for key, value in args.items():
        if isinstance(value, str) and key in _INTS:
            value = None if value.lower() in ("", "none", "auto") else _int(key, value)
        if key == "enable_prefix_caching" and isinstance(value, str):
            value = value.lower() in ("1", "true", "yes")
        if key in own:
            top[key] = value
        elif key in _LLM:
            llm[key] = value
        elif key in _ENGINE:
            engine[key] = value
        else:
            raise ConfigError(f"build_app: unknown argument '{key}'; known: {', '.join(sorted(own | _LLM | _ENGINE))}")
    return RayServeOptions(**top, llm=RunOptions.from_mapping(llm, "build_app").llm_kwargs(), engine=engine)


def _int(key: str, value: str) -> int:
    try:
        return int(float(value)) if "e" in value.lower() else int(value)
    except ValueError:
        raise ConfigError(f"{key}: expected an integer, found '{value}'") from None


# ---- `quill serve --replicas N` ------------------------------------------------------------------------
# Serve's controller drops its HTTP proxy after three readiness checks of 5 s each; a proxy starting on a
# loaded 2-core machine (a fresh environment importing Serve, uvicorn and starlette for the first time) took
# longer, and serve.start then failed.  15 s each still fits serve.start's own 60 s wait.  A cluster started
# elsewhere (--ray-address) reads its own environment: start it with these variables set (CLUSTER_ENV).
PROXY_READY_ENV, PROXY_READY_S = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "15"
# Ray starts its worker processes, Serve's replicas and HTTP proxy among them, at nice 15: on a machine with
# any other busy process they got almost no CPU (a 2-core machine under load: replies 5-10x slower, and a
# proxy that never became ready).  Here they are the server itself: normal priority.
NICENESS_ENV, NICENESS = "RAY_worker_niceness", "0"
CLUSTER_ENV = {PROXY_READY_ENV: PROXY_READY_S, NICENESS_ENV: NICENESS}


def serve_on_ray(options: RayServeOptions, host: str, port: int, ray_address: str | None,
                 log_level: str = "warning") -> int:
    """Run the application on a Ray cluster (``ray_address``; None starts one on this machine) until
    SIGTERM or Ctrl-C, then remove it (and Serve, when no other application is left)."""
    port = _free_port(host, port)
    quiet = log_level not in ("info", "debug")
    if ray_address is None:  # the cluster started here inherits this environment
        for name, value in CLUSTER_ENV.items():
            os.environ.setdefault(name, value)
    try:
        ray.init(address=ray_address, logging_level=logging.WARNING if quiet else logging.INFO,
                 log_to_driver=not quiet, include_dashboard=False)
    except (ConnectionError, ray.exceptions.RayError) as e:
        raise ConfigError(f"cannot join the Ray cluster at {ray_address}: {e}. A cluster with token "
                          f"authentication needs RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN, "
                          f"RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)") from None
    try:
        _check_cpus(options)
        serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
        ingress = serve.run(application(options), name=APP_NAME, route_prefix="/")
        count = options.replicas or f"{options.min_replicas}-{options.max_replicas}"
        name = ingress.options(method_name="model_name").remote().result()
        print(ingress.options(method_name="load_line").remote().result(), file=sys.stderr, flush=True)
        print(f"quill serve: '{name}' at http://{host}:{port}/v1 (Ray Serve: {count} replicas x "
              f"{options.threads_per_replica} threads)", file=sys.stderr, flush=True)
        _wait_for_signal()
    finally:
        _remove_app(options.shutdown_timeout + 15.0)
        ray.shutdown()
    return 0


# Where port 0 ("any free port") looks: below Linux's ephemeral range (32768-60999) and above Ray's
# worker ports (10002-19999).  An ephemeral port that is free now can be taken by one of the many
# processes ray.init starts before the proxy binds it (seen: "Failed to bind to address").
_PICK_PORTS = range(20000, 32000)


def _free_port(host: str, port: int) -> int:
    """``port`` if it can be listened on (0: a free one); a taken port fails here, before Ray starts."""
    if port == 0:
        for candidate in random.Random().sample(_PICK_PORTS, 64):
            if _can_bind(host, candidate) is None:
                return candidate
        raise ConfigError(f"cannot find a free port on {host} in {_PICK_PORTS.start}-{_PICK_PORTS.stop - 1}")
    error = _can_bind(host, port)
    if error is not None:
        raise ConfigError(f"cannot listen on {host}:{port}: {error}")
    return port


def _can_bind(host: str, port: int) -> str | None:
    """None if ``host:port`` can be listened on now, else the reason."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def _check_cpus(options: RayServeOptions) -> None:
    """Refuse at once what the cluster can never place (Ray would wait for the CPUs forever)."""
    have = ray.cluster_resources().get("CPU", 0)
    if options.cpus_needed > have:
        raise ConfigError(f"{options.replicas or options.min_replicas} replicas x {options.threads_per_replica} "
                          f"threads need {options.cpus_needed} CPUs, but the Ray cluster has {have:g}; lower "
                          f"--replicas / --threads-per-replica or add nodes")


def _wait_for_signal() -> None:
    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _remove_app(timeout: float) -> None:
    """Delete the application (replicas finish running requests first) and Serve if nothing else runs on it;
    give up after ``timeout`` seconds (a cluster whose processes were signalled with us may never answer)."""
    done = threading.Event()

    def remove() -> None:
        try:
            serve.delete(APP_NAME)
            if not serve.status().applications:
                serve.shutdown()
        except (ray.exceptions.RayError, RuntimeError) as e:  # the cluster went first: nothing left to remove
            log.warning("could not remove the Ray Serve application: %s", e)
        finally:
            done.set()

    threading.Thread(target=remove, name="quill-serve-teardown", daemon=True).start()
    if not done.wait(timeout):
        log.warning("Ray Serve did not remove the application within %.0f s; leaving it to the cluster", timeout)
