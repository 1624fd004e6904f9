"""``quill serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on one engine.

    quill serve --model path/to/model --port 8000 --api-key sk-local
    curl localhost:8000/v1/chat/completions -H 'Authorization: Bearer sk-local' \\
         -H 'Content-Type: application/json' -d '{"messages": [{"role": "user", "content": "Hi"}]}'

SIGTERM or Ctrl-C stops accepting connections, lets running requests finish for at most
``--shutdown-timeout`` seconds (then aborts them), and exits 0.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import sys
import threading

from quill.cli.common import add_model_args, build_llm, keep_until_exit, run_options
from quill.errors import ConfigError

_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_bytes(text: str, flag: str = "--kv-cache-memory") -> int:
    """'2GiB', '512M', '1e9', '1000000' -> bytes (a ConfigError names ``flag`` and what was found)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise ConfigError(f"{flag}: expected bytes such as 2GiB, 512MB or 1000000, found '{text}'")
    value = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if value < 1:
        raise ConfigError(f"{flag}: expected a positive size, found '{text}'")
    return value


SERVE_BATCHED_TOKENS = 128
# the names of quill.serving.tool_parsers.PARSERS and quill.serving.reasoning.PARSERS (not imported: --help stays light)
TOOL_PARSERS = ("hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=os.environ.get("QUILL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $QUILL_API_KEY, or none)")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: its file name)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="requests decoded together (default 16)")
    # 128, not the offline engine's 256: a step carrying a prompt chunk is a pause for every decoding
    # client, and halving the chunk halved the p99 inter-token latency at 16 clients (1.2B W4A16 on
    # Zen 5: 1400 -> 656 ms, llama-server 1106) at the same throughput (docs/lab/BENCHMARKS-notebook.md)
    p.add_argument("--max-num-batched-tokens", type=int, default=SERVE_BATCHED_TOKENS,
                   help=f"tokens computed per step: decodes plus prefill chunks (default {SERVE_BATCHED_TOKENS}; "
                        "smaller steps pause decoding clients for less time)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="bytes of the KV block pool, e.g. 2GiB (default: 20%% of free RAM, capped at what "
                        "max-num-seqs full contexts need)")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV blocks across requests")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests queued beyond the running batch; more get 503 (default 256)")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="tokens a streamed request gathers before they are sent together (default 1: each at "
                        "once); larger values cost the host less per token, vLLM's option of the same name")
    p.add_argument("--engine-thread", action="store_true",
                   help="step the engine on a thread of its own instead of the server's event loop: /health and "
                        "/metrics answer within milliseconds even during long prefill steps, for ~0.1-0.3 ms more "
                        "host time per streamed token (measured on 2 cores)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM (default 30)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", *TOOL_PARSERS],
                   help="how tool calls are read from answers (default auto: the model family's, from its chat "
                        "template; templates without tools get quill's Hermes-format prompt and parser)")
    p.add_argument("--reasoning-parser", default="auto", choices=["auto", "none", *REASONING_PARSERS],
                   help="split <think> reasoning into reasoning_content (default auto: qwen3 for chat templates "
                        "that know </think>, none for others)")
    h = p.add_argument_group("HTTP limits (quill serve without replicas)")
    h.add_argument("--max-body-size", default=None, metavar="BYTES",
                   help="largest request body, e.g. 8MiB (default); larger ones get 413 before they are read")
    h.add_argument("--header-timeout", type=float, default=None, metavar="S",
                   help="seconds a request's headers may take to arrive, else the connection is closed (default 10)")
    h.add_argument("--body-timeout", type=float, default=None, metavar="S",
                   help="seconds a request's body may take after its headers, else 408 (default 30)")
    h.add_argument("--allowed-hosts", default=None, metavar="H1,H2",
                   help="Host names answered besides localhost, 127.0.0.1, ::1 and the --host address; others get "
                        "400 (stops DNS rebinding); '*': any. Bound to 0.0.0.0 or :: without it: any")
    h.add_argument("--allowed-origins", default=None, metavar="O1,O2",
                   help="browser origins (https://app.example) allowed to call the API through CORS (default: none)")
    r = p.add_argument_group("Ray Serve replicas (pip install 'quill[ray]')")
    r.add_argument("--replicas", type=int, default=None,
                   help="serve from this many quill engines on Ray Serve, behind one endpoint")
    r.add_argument("--min-replicas", type=int, default=None, help="autoscale by queue length from this many ...")
    r.add_argument("--max-replicas", type=int, default=None, help="... to this many replicas")
    r.add_argument("--target-ongoing-requests", type=int, default=None,
                   help="autoscaling: requests per replica to aim at (default: --max-num-seqs)")
    r.add_argument("--autoscaling-config", default=None, metavar="JSON",
                   help="more of Ray Serve's autoscaling settings, e.g. '{\"upscale_delay_s\": 5, "
                        "\"downscale_delay_s\": 120}'")
    r.add_argument("--threads-per-replica", type=int, default=None,
                   help="CPU threads of each replica (default: physical cores / replicas, or / max replicas)")
    r.add_argument("--ingress-replicas", type=int, default=None,
                   help="processes that parse requests and stream tokens back (default 1; each costs ~1-2 ms "
                        "of CPU per streamed token)")
    r.add_argument("--ray-address", default=None,
                   help="the Ray cluster to join ('auto' for the one `ray start` made here; default: start one)")
    p.set_defaults(func=run, check=check)


_RAY_FLAGS = ("replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "autoscaling_config",
              "threads_per_replica", "ingress_replicas", "ray_address")
_HTTP_FLAGS = ("max_body_size", "header_timeout", "body_timeout", "allowed_hosts", "allowed_origins")


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in (text or "").split(",") if x.strip())


def http_options(args) -> dict:
    """The HTTP-limit flags as ``ServeConfig`` keywords (only those given; checked before the model loads)."""
    out = {}
    if args.max_body_size is not None:
        out["max_body_size"] = parse_bytes(args.max_body_size, "--max-body-size")
    for flag in ("header_timeout", "body_timeout"):
        value = getattr(args, flag)
        if value is not None:
            if not value > 0:
                raise ConfigError(f"--{flag.replace('_', '-')}: expected seconds > 0, found {value}")
            out[flag] = value
    if args.allowed_hosts is not None:
        out["allowed_hosts"] = _names(args.allowed_hosts)
    if args.allowed_origins is not None:
        out["allowed_origins"] = _names(args.allowed_origins)
    return out


def check(args) -> None:
    """The flags' own checks, before quill.cli imports torch (a mistyped flag is refused at once)."""
    if args.stream_interval < 1:
        raise ConfigError(f"--stream-interval: expected an integer >= 1, found {args.stream_interval}")
    if not _on_ray(args):
        http_options(args)
        return
    given = [f"--{k.replace('_', '-')}" for k in _HTTP_FLAGS if getattr(args, k) is not None]
    if given:  # Ray's proxy owns the sockets there; the ingress keeps the defaults
        raise ConfigError(f"{', '.join(given)}: not available with replicas (Ray Serve's proxy takes the "
                          "connections)")
    if args.threads is not None:
        raise ConfigError("--threads sets one engine's threads; with replicas use --threads-per-replica")
    if _autoscaled(args) and args.replicas is not None:
        raise ConfigError("--replicas fixes the count and --min-replicas / --max-replicas (and the other "
                          "autoscaling flags) autoscale: give one or the other")
    if _autoscaled(args) and args.max_replicas is None:
        raise ConfigError("autoscaling needs --max-replicas (and takes --min-replicas, default 1)")
    _json_object("--autoscaling-config", args.autoscaling_config)


def _on_ray(args) -> bool:
    return any(getattr(args, k) is not None for k in _RAY_FLAGS)


def _autoscaled(args) -> bool:
    return any(getattr(args, k) is not None for k in ("min_replicas", "max_replicas", "target_ongoing_requests",
                                                      "autoscaling_config"))


def run(args) -> int:
    """(quill.cli runs ``check`` first.)"""
    if _on_ray(args):
        return run_ray(args)
    http = http_options(args)
    import uvicorn

    from quill.engine.core import EngineConfig
    from quill.serving.app import ServeConfig, create_app, default_model_name
    from quill.serving.http_limits import protocol_class

    kv = parse_bytes(args.kv_cache_memory) if args.kv_cache_memory else None
    engine_config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                 kv_cache_memory=kv, enable_prefix_caching=not args.no_prefix_caching)
    sock = _bind(args.host, args.port)  # before loading: a taken port fails at once
    # The model is loaded on the thread that will step it (quill.serving.engine.AsyncEngine): this one,
    # which runs the event loop, or with --engine-thread a thread of its own.
    executor = None
    if args.engine_thread:
        executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="quill-engine")
        llm = executor.submit(build_llm, args, engine_config=engine_config).result()
    else:
        llm = build_llm(args, engine_config=engine_config)
    keep_until_exit(args)  # the one model, served until the process ends
    bound = sock.getsockname()[0]
    if bound != args.host and bound not in ("0.0.0.0", "::"):  # --host named the machine: its address too
        http["allowed_hosts"] = (*http.get("allowed_hosts", ()), bound)
    config = ServeConfig(args.served_model_name, args.api_key, args.max_waiting, args.stream_interval,
                         host=args.host, tool_call_parser=args.tool_call_parser,
                         reasoning_parser=args.reasoning_parser, **http)
    app = create_app(llm, config, executor)
    stats = llm.engine.stats()
    host, port = sock.getsockname()[:2]
    local = stats.kv_local_blocks_total  # the sliding-window layers' own group
    print(f"quill serve: '{config.model_name or default_model_name(llm.path)}' at http://{_url_host(host)}:{port}/v1 "
          f"({stats.kv_blocks_total} KV blocks of {engine_config.block_size} tokens"
          f"{f' (+ {local} for the sliding-window layers)' if local else ''} in "
          f"{llm.engine.kv_cache_dtype}, up to {args.max_num_seqs} "
          f"sequences at once)", file=sys.stderr, flush=True)
    server = _server_class()(uvicorn.Config(app, log_level=args.log_level, access_log=False,
                                    timeout_graceful_shutdown=args.shutdown_timeout,
                                    http=protocol_class(config.header_timeout, config.body_timeout)))
    try:
        server.run(sockets=[sock])
    finally:
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
    return 0


def run_ray(args) -> int:
    """``quill serve --replicas N ...``: the same API from replicas on Ray Serve."""
    if args.ray_address is not None:
        token_auth_like_ray()
    try:
        from quill.serving.ray import RayServeOptions, serve_on_ray
    except ImportError as e:
        raise ConfigError(f"--replicas / --ray-address need Ray Serve: pip install 'quill[ray]' ({e})") from None
    from quill.platform import detect

    autoscale = _autoscaled(args)  # (the combinations were checked: check)
    replicas = None if autoscale else (args.replicas if args.replicas is not None else 1)
    lo = args.min_replicas if args.min_replicas is not None else 1
    hi = args.max_replicas if args.max_replicas is not None else lo
    # every replica that may run gets its share of this machine's cores unless told otherwise
    threads = args.threads_per_replica or max(1, detect().default_threads // (replicas or hi))
    llm = run_options(args).llm_kwargs()  # every model option, as the one-engine server passes them
    engine = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
              "kv_cache_memory": parse_bytes(args.kv_cache_memory) if args.kv_cache_memory else None,
              "enable_prefix_caching": not args.no_prefix_caching}
    options = RayServeOptions(model=str(args.model) if args.model else None, replicas=replicas, min_replicas=lo,
                              max_replicas=hi, target_ongoing_requests=args.target_ongoing_requests,
                              autoscaling=_json_object("--autoscaling-config", args.autoscaling_config),
                              threads_per_replica=threads, ingress_replicas=args.ingress_replicas or 1,
                              llm=llm, engine=engine,
                              model_name=args.served_model_name, api_key=args.api_key, max_waiting=args.max_waiting,
                              stream_interval=args.stream_interval,
                              shutdown_timeout=args.shutdown_timeout, tool_call_parser=args.tool_call_parser,
                              reasoning_parser=args.reasoning_parser)
    return serve_on_ray(options, args.host, args.port, args.ray_address, args.log_level)


def _json_object(flag: str, text: str | None) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag}: not valid JSON ({e}): {text}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}: expected a JSON object, found {text}")
    return value


def token_auth_like_ray() -> None:
    """Send the local Ray token when joining a cluster by address, as Ray does for a cluster it starts.

    Ray enables token authentication for clusters started where a token exists (~/.ray/auth_token,
    RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH) but, with RAY_AUTH_MODE unset, connects to an explicit
    address without it and is refused.  Ray reads the mode once, at import: call this before
    ``import ray``.  An explicit RAY_AUTH_MODE is left alone."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    token_file = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(token_file):
        os.environ["RAY_AUTH_MODE"] = "token"


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _server_class():
    """Built on first use: uvicorn is imported only by `quill serve`."""
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn's server, except that a signal-initiated graceful stop ends the process normally (exit 0)
        instead of re-raising the signal once the server has shut down."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)

    return _Server
