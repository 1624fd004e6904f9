"""``quill bench serve``: one load against ``quill serve`` and llama.cpp's ``llama-server``, in the same run.

    quill bench serve --llama-server /path/to/llama-server            # the default model, 1 4 16 64 clients
    quill bench serve --model model.gguf --llama-server BIN --json out.json
    quill bench serve --url http://host:8000 --served-model NAME        # any running OpenAI endpoint
    quill bench serve --ray 1x2,2x1 --clients 4,16                      # + quill on Ray Serve: replicas x threads

Both servers run side by side (each idle while the other is measured); for every client
count the two take turns, round after round, and medians of the rounds are reported.  The
in-process ``LLM.generate`` decode rate of the same single-client requests is measured too,
alternating with the server read by a reader that costs the host nothing while it streams
(``quill.bench.light``; the load client's own parsing shares the server's cores), so the
server's own overhead shows.  With ``--ray``, each replicas x threads layout runs as
``quill serve --replicas R --threads-per-replica T`` (a Ray cluster of its own) beside the
direct server, and the latency the Ray ingress adds to a one-token request is measured.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from quill.bench import settled
from quill.bench.light import stream_once
from quill.bench.load import LoadResult, Workload, run_load
from quill.bench.stats import median
from quill.errors import ConfigError


def register(bsub) -> None:
    p = bsub.add_parser("serve", help="quill serve against llama.cpp's llama-server under the same load")
    p.add_argument("--model", default=None, help="model for quill serve (default: the default model)")
    p.add_argument("--gguf", default=None, help="GGUF file for llama-server (default: --model when it is one)")
    p.add_argument("--llama-server", default=None, help="llama-server binary (without it: quill only)")
    p.add_argument("--llama-server-name", default=None,
                   help="what the JSON calls that server (default: its --version), e.g. 'ik_llama.cpp 8337e4c "
                        "llama-server' for a build without a version")
    p.add_argument("--url", default=None, help="bench this running OpenAI endpoint instead of starting quill serve")
    p.add_argument("--served-model", default=None, help="model name at --url (default: its first model)")
    p.add_argument("--clients", default="1,4,16,64", help="concurrent clients, comma-separated")
    p.add_argument("--requests", type=int, default=None, help="requests per client count (default: 2 x clients, >= 6)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per client count; medians reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="threads of each server (default: the usable physical cores)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="quill's --max-num-seqs (default: most clients)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra argument for quill serve (repeatable)")
    p.add_argument("--ray", default=None, metavar="RxT,...",
                   help="also quill on Ray Serve in these layouts: R replicas x T threads each, e.g. 1x2,2x1")
    p.add_argument("--overhead-requests", type=int, default=40,
                   help="one-token requests per endpoint for the Ray ingress's added latency (default 40)")
    p.add_argument("--json-schema", type=Path, default=None,
                   help="a JSON schema file every request is held to (llama-server's `json_schema` field, which "
                        "quill serve also takes): structured outputs under load")
    p.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    p.set_defaults(func=run)


@dataclass
class Endpoint:
    name: str
    url: str  # base, without /v1
    model: str
    proc: subprocess.Popen | None = None
    log: Path | None = None  # the process's stderr, when kept: its tail explains an exit before ready

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(ep: Endpoint, timeout: float = 600.0) -> Endpoint:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ep.proc is not None and ep.proc.poll() is not None:
            tail = "" if ep.log is None else ":\n" + "\n".join(ep.log.read_text(errors="replace").splitlines()[-15:])
            raise ConfigError(f"{ep.name} exited with code {ep.proc.returncode} before it was ready{tail}")
        try:
            if httpx.get(ep.url + "/health", timeout=5).status_code == 200:
                models = httpx.get(ep.url + "/v1/models", timeout=5).json()["data"]
                ep.model = ep.model or models[0]["id"]
                return ep
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ConfigError(f"{ep.name} at {ep.url} was not ready after {timeout:.0f} s")


def _ready_or_closed(ep: Endpoint) -> Endpoint:
    """``ep`` once it answers; closed when it does not (an exit, a timeout, Ctrl-C or SIGTERM while waiting)."""
    try:
        return _wait_ready(ep)
    except BaseException:
        ep.close()
        raise


@contextmanager
def sigterm_exits():
    """SIGTERM ends the benchmark as Ctrl-C does: the with-blocks holding its servers close them."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _start(name: str, cmd: list[str], port: int, log: Path | None) -> Endpoint:
    """``cmd`` started (stderr into ``log``, or discarded) and waited for until it answers."""
    with open(log if log is not None else "/dev/null", "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    return _ready_or_closed(Endpoint(name, f"http://127.0.0.1:{port}", "", proc, log))


def launch_quill(model: str, threads: int, max_num_seqs: int, extra: list[str], log: Path | None = None) -> Endpoint:
    port = _free_port()
    cmd = [sys.executable, "-m", "quill", "serve", "--port", str(port), "--threads", str(threads),
           "--max-num-seqs", str(max_num_seqs), *(["--model", model] if model else []), *extra]
    return _start("quill serve", cmd, port, log)


def launch_quill_ray(model: str | None, replicas: int, threads: int, max_num_seqs: int,
                     extra: list[str]) -> Endpoint:
    """``quill serve --replicas R --threads-per-replica T`` with a Ray cluster of its own."""
    port = _free_port()
    cmd = [sys.executable, "-m", "quill", "serve", "--port", str(port), "--replicas", str(replicas),
           "--threads-per-replica", str(threads), "--max-num-seqs", str(max_num_seqs),
           *(["--model", model] if model else []), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return _ready_or_closed(Endpoint(f"ray {replicas}x{threads}", f"http://127.0.0.1:{port}", "", proc))


def ray_layouts(text: str | None) -> list[tuple[int, int]]:
    """'1x2,2x1' -> [(1, 2), (2, 1)] (replicas, threads per replica)."""
    out = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        try:
            r, t = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise ConfigError(f"--ray: expected layouts like 1x2,2x1 (replicas x threads), found '{item}'") from None
        if r < 1 or t < 1:
            raise ConfigError(f"--ray: replicas and threads must be >= 1, found '{item}'")
        out.append((r, t))
    return out


async def _one_token_latency(url: str, model: str, prompt: str) -> float:
    import httpx
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        start = time.monotonic()
        r = await http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1,
                                                     "temperature": 0})
        r.raise_for_status()
        return time.monotonic() - start


def ingress_overhead(eps: list[Endpoint], count: int) -> dict:
    """Median latency of one-token completions (short prompt, no prefix-cache reuse: a new prompt each
    time), sequential, endpoints alternating; each Ray layout's excess over the direct server."""
    lat: dict[str, list[float]] = {ep.name: [] for ep in eps}
    for i in range(count):
        prompt = f"Request {i}: name one colour."
        for ep in (eps if i % 2 == 0 else eps[::-1]):
            lat[ep.name].append(asyncio.run(_one_token_latency(ep.url, ep.model, prompt)))
    med = {name: median(v) * 1000 for name, v in lat.items()}
    direct = med[eps[0].name]
    return {"requests": count, "median_ms": med,
            "added_ms": {name: m - direct for name, m in med.items() if name != eps[0].name}}


def launch_llama_server(binary: str, gguf: str, threads: int, slots: int, ctx_per_slot: int,
                        extra: list[str] = (), log: Path | None = None) -> Endpoint:
    """llama-server with continuous batching (on by default; -cb says so) and one slot per client."""
    if not Path(binary).is_file():
        raise ConfigError(f"--llama-server: no such file '{binary}'")
    port = _free_port()
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb", str(threads),
           "-np", str(slots), "-cb", "-c", str(slots * ctx_per_slot), *_no_webui(binary), *extra]
    return _start("llama-server", cmd, port, log)


def _no_webui(binary: str) -> list[str]:
    """The flag that turns the web UI off, as this llama-server spells it (mainline ``--no-webui``,
    ik_llama.cpp ``--webui none``); none when its --help shows neither."""
    p = subprocess.run([binary, "--help"], capture_output=True, text=True, check=False, timeout=60)
    usage = p.stdout + p.stderr
    if re.search(r"--no-webui(?![\w-])", usage):  # not --no-webui-mcp-proxy
        return ["--no-webui"]
    return ["--webui", "none"] if "--webui NAME" in usage else []


def _median_summary(results: list[LoadResult]) -> dict:
    sums = [r.summary() for r in results]
    out = {k: median(s[k] for s in sums) for k in sums[0] if k not in ("clients", "first_error")}
    out["errors_seen"] = [s["first_error"] for s in sums if s["first_error"]]
    out["clients"] = sums[0]["clients"]
    out["rounds"] = [{k: s[k] for k in ("output_tok_s", "itl_p99_ms", "ttft_p50_ms")} for s in sums]
    return out


def _single_client(ep: Endpoint, model: str | None, workload: Workload, threads: int, rounds: int) -> dict:
    """Single-client decode tok/s of the same requests through the server (read by ``quill.bench.light``,
    a reader that leaves the cores to the server) and through ``LLM.generate`` in this process,
    alternating round by round; medians."""
    import quill
    llm = settled(quill.LLM(model, threads=threads))
    requests = workload.requests[:4]
    server, direct = [], []
    for r in range(max(2, rounds)):
        for side in ((0, 1) if r % 2 == 0 else (1, 0)):
            for prompt, n in requests:
                if side == 0:
                    rec = stream_once(ep.url, ep.model, prompt, n)
                    if rec.error is None and len(rec.chunks) > 2:
                        server.append((len(rec.chunks) - 1) / (rec.chunks[-1] - rec.chunks[0]))
                else:
                    out = llm.generate(prompt, quill.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
                    direct.append(out.timings.decode_tps)
    del llm
    return {"server_light_decode_tok_s": median(server) if server else float("nan"),
            "llm_generate_decode_tok_s": median(direct)}


def _server_decode(result: LoadResult) -> float:
    """Single-client decode tok/s through the server: (tokens - 1) / (last chunk - first chunk), median."""
    rates = [(len(r.chunks) - 1) / (r.chunks[-1] - r.chunks[0]) for r in result.records
             if r.error is None and len(r.chunks) > 2]
    return median(rates) if rates else float("nan")


def run(args) -> int:
    with sigterm_exits():
        return _run(args)


def _run(args) -> int:
    from quill.default_model import default_model_path
    from quill.platform import detect

    platform = detect()
    threads = args.threads or platform.default_threads
    levels = [int(c) for c in args.clients.split(",") if c.strip()]
    gguf = args.gguf or (args.model if args.model and str(args.model).endswith(".gguf") else None)
    if args.llama_server and gguf is None:
        gguf = None if args.model else str(default_model_path())
        if gguf is None:
            raise ConfigError("--llama-server needs a GGUF file: pass --gguf (or a .gguf --model)")
    from quill.bench.meta import run_metadata

    meta = run_metadata(platform, threads, llama_server=args.llama_server,
                        command="quill " + shlex.join(getattr(args, "argv", None) or sys.argv[1:]))
    if args.llama_server_name:
        meta["llama_cpp"] = args.llama_server_name
    # which model and quill mode ran: the page labels its serving rows from these
    meta |= {"model": str(args.model or default_model_path()), "serve_args": list(args.serve_arg or [])}
    if args.json_schema:
        meta["json_schema"] = json.loads(args.json_schema.read_text())
    report = {"cpu": platform.summary(), "threads": threads, "meta": meta, "levels": {}}
    print(f"cpu: {platform.summary()}, {threads} threads per server")
    layouts = ray_layouts(args.ray)
    with ExitStack() as stack:
        eps = []
        if args.url:
            eps.append(_wait_ready(Endpoint("endpoint", args.url.rstrip("/"), args.served_model or "")))
        else:
            eps.append(launch_quill(args.model, threads, args.max_num_seqs or max(levels), args.serve_arg))
        stack.callback(eps[0].close)
        for replicas, per in layouts:
            eps.append(launch_quill_ray(args.model, replicas, per, args.max_num_seqs or max(levels), args.serve_arg))
            stack.callback(eps[-1].close)
        fixed = len(eps)  # llama-server comes and goes per client count
        for clients in levels:
            # llama-server gets one slot per client at every level (its KV cache and attention
            # span all slots, so 64 slots would slow a 4-client load); quill keeps one engine
            # sized for the most clients.
            if args.llama_server:
                eps[fixed:] = [launch_llama_server(args.llama_server, gguf, threads, clients, 1024)]
            try:
                level = _level(args, eps, clients, threads)
            finally:
                for ep in eps[fixed:]:
                    ep.close()
            report["levels"][clients] = level
            _print_level(clients, level["requests"], level, [ep.name for ep in eps])
        if layouts:
            report["ingress_overhead"] = ingress_overhead(eps[:fixed], args.overhead_requests)
            o = report["ingress_overhead"]
            print(f"\none-token request latency, median of {o['requests']}: "
                  + ", ".join(f"{n} {m:.1f} ms" for n, m in o["median_ms"].items())
                  + "; added by Ray: " + ", ".join(f"{n} {m:+.1f} ms" for n, m in o["added_ms"].items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _level(args, eps: list[Endpoint], clients: int, threads: int) -> dict:
    """One client count: alternating rounds against every endpoint, medians."""
    count = args.requests or max(6, 2 * clients)
    runs: dict[str, list[LoadResult]] = {ep.name: [] for ep in eps}
    for r in range(args.rounds):
        # New prompts every round: a round must not hit prefix-cache entries an earlier
        # round left (quill keeps every block it can; llama-server one prompt per slot).
        work = Workload.random(count, seed=args.seed + 1000 * r + clients)
        extra = {"json_schema": json.loads(args.json_schema.read_text())} if args.json_schema else None
        for ep in (eps if r % 2 == 0 else eps[::-1]):
            runs[ep.name].append(asyncio.run(run_load(ep.url, ep.model, work, clients, extra=extra)))
    work = Workload.random(count, seed=args.seed + clients)  # round 0's: the in-process baseline
    level = {name: _median_summary(res) for name, res in runs.items()}
    level["workload"] = work.description + f"; round r draws seed {args.seed + clients} + 1000 r"
    if clients == 1:
        level["server_decode_tok_s"] = median(_server_decode(r) for r in runs[eps[0].name])
        if not args.url and not args.json_schema:  # the in-process baseline runs free requests
            level.update(_single_client(eps[0], args.model, work, threads, args.rounds))
    level["requests"] = count
    return level


def _print_level(clients: int, count: int, level: dict, names: list[str]) -> None:
    print(f"\n{clients} client(s), {count} requests (medians of rounds)")
    print(f"  {'server':<14} {'out tok/s':>10} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'errors':>6}")
    for name in names:
        s = level[name]
        print(f"  {name:<14} {s['output_tok_s']:>10.1f} {s['requests_s']:>7.2f} {s['ttft_p50_ms']:>7.0f}ms "
              f"{s['ttft_p99_ms']:>7.0f}ms {s['itl_p50_ms']:>6.1f}ms {s['itl_p99_ms']:>6.1f}ms {s['errors']:>6.0f}")
    for name in names:
        for err in level[name]["errors_seen"]:
            print(f"  {name} error: {err}")
    for other in names[1:]:
        a, b = level[names[0]], level[other]
        print(f"  ratio {names[0]} / {other}: output tok/s {a['output_tok_s'] / b['output_tok_s']:.2f}x, "
              f"ITL p99 {a['itl_p99_ms'] / b['itl_p99_ms']:.2f}x")
    if "llm_generate_decode_tok_s" in level:
        base, light = level["llm_generate_decode_tok_s"], level["server_light_decode_tok_s"]
        print(f"  single client decode: LLM.generate {base:.1f} tok/s; through the server, read by the load "
              f"client {level['server_decode_tok_s']:.1f} ({level['server_decode_tok_s'] / base:.2f}x), by a "
              f"light reader {light:.1f} ({light / base:.2f}x)")
