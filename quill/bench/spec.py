"""``quill bench spec``: speculative decoding in quill serve and llama.cpp's llama-server, same files and prompts.

    quill bench spec                                           # the default model: no speculation, n-gram lookup
    quill bench spec --llama-server /work/llama-build/bin/llama-server --json spec.json
    quill bench spec --targets q8_0,f16 --llama-server BIN      # llama.cpp's Q8_0 / F16 copies of the default
                                                               # model, its own Q4_1 file drafting for them
    quill bench spec --target big.gguf --draft small.gguf --k 4 --clients 1,16 --rounds 3

Each configuration is a server: quill serve without speculation, with n-gram prompt lookup
(``{"method": "ngram", "num_speculative_tokens": K}``, lookups of 1-3 tokens) and with a draft model
(``{"method": "draft_model", "model": DRAFT, "num_speculative_tokens": K}``); llama-server without
speculation, with ``--spec-type ngram-simple`` (its self-speculation closest to prompt lookup: the last
min(3, K) tokens looked up in the sequence's prompt and output, the up to K tokens after their latest earlier
occurrence drafted; it needs K >= that lookup length) and with ``-md DRAFT --spec-type draft-simple
--spec-draft-n-max K``.  A target's servers are up side by side (each idle while another is measured:
quill's once, llama-server's once per client count, one slot per client) and take turns, round after
round, in a rotating order, quill and llama-server alternating within a configuration; medians of the
rounds.  Neither reuses a prompt's KV across requests (quill ``--no-prefix-caching``, llama-server
``--no-cache-prompt``), so every round computes the same requests the same way.

The prompts (quill.bench.spec_prompts) are two sets of 8: copy-heavy (rewrite, edit, summarise or repeat
a given passage or code) and free chat.  Each is one user message to /v1/chat/completions, streamed,
greedy, answered until the answer ends or ``--max-tokens``.  One client sends a set once, request after
request; C clients (closed loop) send max(set size, 2 C) requests cycling through it.  Per round: decode
tok/s of a request ((completion tokens - 1) / (its finish - its first token), median over requests),
output tok/s (every token / the round's wall time), and the acceptance (accepted / drafted tokens: quill's
/metrics counters before and after, llama-server's per-request ``timings.draft_n`` and
``draft_n_accepted``).  The headline figure is decode tok/s at one client and output tok/s at more;
speed-ups are against the same engine without speculation, and quill against llama-server per configuration.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import sys
import tempfile
from contextlib import ExitStack
from functools import partial
from pathlib import Path

from quill.bench.spec_prompts import SETS
from quill.bench.stats import median
from quill.errors import ConfigError

METHODS = ("none", "ngram", "draft")
ENGINES = ("quill", "llama-server")
# issue 39's goals for quill: the headline figure against the same server without speculation, one stream; with
# more clients a batched step already shares the weight reads, and the goal is to cost no more than a few percent
GOALS = {("ngram", "copy"): 1.5, ("ngram", "chat"): 0.97, ("draft", "copy"): 1.3, ("draft", "chat"): 1.3}
MANY_CLIENTS_GOAL = 0.95


def register(bsub) -> None:
    p = bsub.add_parser("spec", help="speculative decoding (n-gram lookup, draft model): quill serve and llama-server")
    p.add_argument("--target", type=Path, default=None, help="the model sped up (default: the default model)")
    p.add_argument("--targets", default=None, metavar="TYPES",
                   help="bench llama.cpp-quantized copies of --target instead, e.g. q8_0,f16 (made once, into --out)")
    p.add_argument("--draft", type=Path, default=None,
                   help="draft model (default: --target itself with --targets; else the default model when "
                        "--target is another file; else none)")
    p.add_argument("--llama-server", default=None, help="llama-server binary (without it: quill only)")
    p.add_argument("--llama-python", default=None,
                   help="python with llama-cpp-python, whose quantizer makes --targets (default: .venv-llamacpp)")
    p.add_argument("--out", type=Path, default=None,
                   help="where --targets files go (default: ~/.cache/quill/bench/gguf, or under $QUILL_CACHE_DIR)")
    p.add_argument("--methods", default=",".join(METHODS), help="configurations: none, ngram, draft (default: all; "
                   "draft only when there is a draft)")
    p.add_argument("--sets", default=",".join(SETS), help="prompt sets: copy (copy-heavy), chat (free chat)")
    p.add_argument("--prompts", type=int, default=None, help="the first N prompts of each set (default: all 8)")
    p.add_argument("--k", type=int, default=3, help="draft tokens per step at most (num_speculative_tokens)")
    p.add_argument("--max-tokens", type=int, default=128, help="answer length cap (answers end where they end)")
    p.add_argument("--clients", default="1,16", help="concurrent clients, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians reported")
    p.add_argument("--threads", type=int, default=2, help="threads of each server")
    p.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    p.set_defaults(func=run, check=check)


def _names(text: str, flag: str, known: tuple[str, ...] | None = None) -> list[str]:
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if (n not in known if known else not re.fullmatch(r"[a-z0-9_]+", n))]
    if not names or unknown:
        raise ConfigError(f"{flag} '{text}': " + (f"unknown {', '.join(unknown)}; " if unknown else "empty; ")
                          + (f"supported: {', '.join(known)}" if known else "expected llama.cpp types like q8_0,f16"))
    return names


def check(args) -> dict:
    """Every option checked before anything starts (quill.cli runs this before importing torch); the parsed values."""
    from quill.default_model import default_model_path

    for name in ("k", "max_tokens", "rounds", "threads", "prompts"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: expected an integer >= 1, found {v}")
    try:
        levels = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ConfigError(f"--clients '{args.clients}': expected comma-separated integers >= 1, e.g. 1,16")
    methods, sets = _names(args.methods, "--methods", METHODS), _names(args.sets, "--sets", tuple(SETS))
    if args.llama_server is not None and not (Path(args.llama_server).is_file()
                                              and os.access(args.llama_server, os.X_OK)):
        raise ConfigError(f"--llama-server: no executable file '{args.llama_server}'")
    for flag, path in (("--target", args.target), ("--draft", args.draft)):
        if path is not None and not path.is_file():
            raise ConfigError(f"{flag}: no such file '{path}'")
    if args.llama_server and args.target is not None and args.target.suffix != ".gguf":
        raise ConfigError(f"--target {args.target}: llama-server runs GGUF files only")
    types = _names(args.targets, "--targets") if args.targets else []
    from quill.bench.meta import REPO

    python = args.llama_python or str(REPO / ".venv-llamacpp" / "bin" / "python")
    if types and not Path(python).is_file():
        raise ConfigError(f"--targets needs llama.cpp's quantizer: no python at '{python}' (--llama-python; "
                          "`make llamacpp` installs it)")
    default = default_model_path()
    has_draft = bool(args.draft or types or (args.target and args.target.resolve() != default.resolve()))
    dropped = "draft" in methods and not has_draft
    if dropped:
        if args.methods != ",".join(METHODS):
            raise ConfigError("--methods draft: no draft model: pass --draft (the target is the default model)")
        methods.remove("draft")
    return {"levels": levels, "methods": methods, "sets": sets, "types": types, "python": python, "default": default,
            "no_draft": dropped}


def _targets(args, s: dict) -> list[tuple[Path, Path | None]]:
    """(target, draft or None) pairs: --target, or its --targets copies made by llama.cpp's quantizer."""
    source = args.target or s["default"]
    if s["types"]:
        from quill.bench.llamacpp import quantize_with_llamacpp
        from quill.prepacked.store import default_cache_dir

        out = args.out or default_cache_dir() / "bench" / "gguf"
        out.mkdir(parents=True, exist_ok=True)
        files = []
        for t in s["types"]:
            print(f"llama.cpp's quantizer: {source.name} -> {t.upper()} (once, into {out})", flush=True)
            try:
                files.append(quantize_with_llamacpp(s["python"], source, out / f"{source.stem}.{t.upper()}.gguf", t))
            except RuntimeError as e:
                raise ConfigError(f"--targets {t}: {e}") from None
        draft = args.draft or source
    else:
        files = [source]
        draft = args.draft or (s["default"] if source.resolve() != s["default"].resolve() else None)
    pairs = [(f, None if draft is None or draft.resolve() == f.resolve() else draft) for f in files]
    if "draft" in s["methods"]:
        from quill.engine.draft import check_same_tokenizer

        for target, d in pairs:
            if d is not None:
                try:
                    check_same_tokenizer(target, d)
                except ConfigError as e:
                    raise ConfigError(f"--draft {d}: {e}") from None
    return pairs


def server_args(engine: str, method: str, k: int, draft: Path | None) -> list[str]:
    """What a configuration adds to quill serve's / llama-server's command line."""
    if engine == "quill":
        spec = {"ngram": {"method": "ngram", "num_speculative_tokens": k},
                "draft": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}}.get(method)
        return ["--no-prefix-caching", *(["--speculative-config", json.dumps(spec)] if spec else [])]
    extra = {"none": [], "draft": ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(k)],
             "ngram": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(min(3, k)),
                       "--spec-ngram-simple-size-m", str(k)]}[method]
    return ["--no-cache-prompt", *extra]


def run(args) -> int:
    from quill.bench.serve import sigterm_exits

    with sigterm_exits():
        return _run(args)


def _run(args) -> int:
    from quill.bench.meta import run_metadata
    from quill.platform import detect

    s = check(args)
    if s["no_draft"]:
        print("no draft configuration: the target is the default model (--draft FILE adds one)")
    pairs = _targets(args, s)
    meta = run_metadata(detect(), args.threads, llama_server=args.llama_server,
                        command="quill " + shlex.join(getattr(args, "argv", None) or sys.argv[1:]))
    sets = {name: list(SETS[name][:args.prompts]) for name in s["sets"]}
    report = {"meta": meta, "settings": {
        "k": args.k, "max_tokens": args.max_tokens, "clients": s["levels"], "rounds": args.rounds,
        "threads": args.threads, "methods": s["methods"], "llama_server": args.llama_server, "goals": {
            f"{m} {st}": g for (m, st), g in GOALS.items()} | {"more than one client": MANY_CLIENTS_GOAL},
        "llama_server_ngram": f"--spec-type ngram-simple: the last {min(3, args.k)} tokens (lookup) found in the "
                              f"sequence's prompt and output, the up to {args.k} tokens after their latest earlier "
                              "occurrence drafted (quill: longest suffix of 3..1 tokens first)",
        "measures": "decode_tok_s: per request (completion tokens - 1) / (finish - first token), median over "
                    "requests; output_tok_s: all completion tokens / the round's wall; acceptance: accepted / "
                    "drafted tokens; headline: decode_tok_s at 1 client, output_tok_s at more",
        "prompts": sets}, "results": []}
    for target, draft in pairs:
        methods = [m for m in s["methods"] if m != "draft" or draft is not None]
        print(f"\n{target.name}: draft {draft.name if draft else '-'}, K {args.k}, {args.threads} threads, "
              f"configurations {', '.join(methods)}", flush=True)
        report["results"].append(_bench_target(args, s["levels"], target, draft, methods, sets))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


def _bench_target(args, levels: list[int], target: Path, draft: Path | None, methods: list[str],
                  sets: dict[str, list[str]]) -> dict:
    from quill.bench.serve import launch_llama_server, launch_quill

    result = {"target": str(target), "draft": None if draft is None else str(draft), "servers": {}, "levels": {}}
    ctx = 1024 + args.max_tokens  # llama-server's context per slot: the longest prompt and its answer
    with tempfile.TemporaryDirectory(prefix="quill-bench-spec-") as logs, ExitStack() as stack:
        starts = {}
        for m in methods:
            extra = server_args("quill", m, args.k, draft)
            starts[f"quill {m}"] = partial(launch_quill, str(target), args.threads, max(levels), extra,
                                           log=Path(logs) / f"quill-{m}.log")
            result["servers"][f"quill {m}"] = ["quill", "serve", "--threads", str(args.threads), "--max-num-seqs",
                                               str(max(levels)), *extra]
        fixed = _launch(starts, stack)
        for clients in levels:
            with ExitStack() as level_stack:
                starts = {}
                for m in methods if args.llama_server else ():
                    extra = server_args("llama-server", m, args.k, draft)
                    starts[f"llama-server {m}"] = partial(launch_llama_server, args.llama_server, str(target),
                                                          args.threads, clients, ctx, extra,
                                                          log=Path(logs) / f"llama-{m}-{clients}.log")
                    result["servers"][f"llama-server {m}"] = ["llama-server", "-t", str(args.threads), "-np",
                                                              "CLIENTS", "-c", f"CLIENTS x {ctx}", *extra]
                eps = fixed | _launch(starts, level_stack)
                for ep in eps.values():
                    _measure(ep, ["Say hello."], 1, 8)  # warm-up
                level = _level(eps, methods, sets, clients, args)
            result["levels"][str(clients)] = level
            _print_level(target.name, clients, level, args.rounds)
    result["goals"] = [g for clients, level in result["levels"].items() for g in _goals(int(clients), level)]
    for g in result["goals"]:
        print(f"  goal {g['config']} {g['set']}, {g['clients']} client(s): {g['speedup']:.2f}x against >= "
              f"{g['goal']}x: {'met' if g['met'] else 'not met'}")
    return result


def _launch(starts: dict, stack: ExitStack) -> dict:
    """Every server of ``starts`` (name -> a launch) started at once; each closed by ``stack`` (all of them when one
    fails to start)."""
    from concurrent.futures import ThreadPoolExecutor

    if not starts:
        return {}
    pool = ThreadPoolExecutor(len(starts))
    futures = {name: pool.submit(start) for name, start in starts.items()}
    try:
        pool.shutdown(wait=True)
    except BaseException:  # Ctrl-C or SIGTERM while they start: each server closes as its start returns
        for future in futures.values():
            future.add_done_callback(_close_started)
        raise
    eps, error = {}, None
    for name, future in futures.items():
        try:
            eps[name] = future.result()
        except ConfigError as e:  # raised below, once the others are in the stack
            error = error or ConfigError(f"{name}: {e}")
            continue
        except Exception as e:  # noqa: BLE001 - the same
            error = error or e
            continue
        eps[name].name = name
        stack.callback(eps[name].close)
    if error is not None:
        raise error
    return eps


def _close_started(future) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()


def _order(methods: list[str], r: int) -> list[str]:
    """Round r's turn order: the configurations rotated by r, quill first in even rounds, llama-server in odd."""
    shift = r % len(methods)
    engines = ENGINES if r % 2 == 0 else ENGINES[::-1]
    return [f"{e} {m}" for m in methods[shift:] + methods[:shift] for e in engines]


def _level(eps: dict, methods: list[str], sets: dict[str, list[str]], clients: int, args) -> dict:
    runs = {st: {name: [] for name in eps} for st in sets}
    key = "decode_tok_s" if clients == 1 else "output_tok_s"
    for r in range(args.rounds):
        for name in (n for n in _order(methods, r) if n in eps):
            for st, texts in sets.items():
                runs[st][name].append(_measure(eps[name], texts, clients, args.max_tokens))
            print(f"  {clients} client(s), round {r + 1}/{args.rounds}, {name}: {key.replace('_tok_s', '')} tok/s "
                  + ", ".join(f"{st} {_fmt(runs[st][name][-1][key], '.1f', 0)}" for st in sets), flush=True)
    level = {}
    for st in sets:
        configs = {name: {"median": _medians(rounds), "rounds": rounds} for name, rounds in runs[st].items()}
        head = {name: c["median"][key] for name, c in configs.items()}
        speedup = {name: _ratio(v, head.get(f"{name.split()[0]} none")) for name, v in head.items()
                   if not name.endswith(" none") and f"{name.split()[0]} none" in head}
        vs_llama = {m: _ratio(head[f"quill {m}"], head[f"llama-server {m}"]) for m in methods
                    if f"llama-server {m}" in head}
        level[st] = {"headline": key, "configs": configs, "speedup": speedup, "quill_vs_llama_server": vs_llama}
    return level


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _decode_rate(rec) -> float | None:
    end = rec.finished or (rec.chunks[-1] if rec.chunks else None)
    if rec.error is not None or rec.tokens < 2 or not rec.chunks or end <= rec.chunks[0]:
        return None
    return (rec.tokens - 1) / (end - rec.chunks[0])


def _quill_counters(url: str) -> tuple[float, float]:
    """quill serve's (draft tokens, accepted tokens) counters, from /metrics."""
    import httpx

    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:spec_decode_num_"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0.0) + float(value)
    return (values.get("vllm:spec_decode_num_draft_tokens_total", 0.0),
            values.get("vllm:spec_decode_num_accepted_tokens_total", 0.0))


def _measure(ep, texts: list[str], clients: int, max_tokens: int) -> dict:
    """One set through ``ep`` with ``clients`` closed-loop clients: speeds, tokens and drafts."""
    from quill.bench.load import Workload, run_load

    count = len(texts) if clients == 1 else max(len(texts), 2 * clients)
    work = Workload(tuple((texts[i % len(texts)], max_tokens) for i in range(count)), f"{count} chat requests")
    quill = ep.name.startswith("quill")
    before = _quill_counters(ep.url) if quill else None
    res = asyncio.run(run_load(ep.url, ep.model, work, clients, chat=True))
    ok = [r for r in res.records if r.error is None]
    if not ok:
        raise ConfigError(f"{ep.name}: every request failed, e.g. {res.records[0].error}")
    if quill:
        after = _quill_counters(ep.url)
        drafted, accepted = after[0] - before[0], after[1] - before[1]
    else:
        drafted = sum(r.timings.get("draft_n", 0) for r in ok)
        accepted = sum(r.timings.get("draft_n_accepted", 0) for r in ok)
    rates = [v for v in map(_decode_rate, ok) if v is not None]
    tokens = sum(r.tokens for r in ok)
    return {"requests": len(ok), "errors": len(res.records) - len(ok),
            "first_error": next((r.error for r in res.records if r.error), None), "wall_s": res.wall,
            "tokens": tokens, "tokens_per_request": tokens / len(ok),
            "decode_tok_s": median(rates) if rates else None, "output_tok_s": tokens / res.wall,
            "draft_tokens": int(drafted), "accepted_tokens": int(accepted),
            "acceptance": accepted / drafted if drafted else None}


def _medians(rounds: list[dict]) -> dict:
    out = {}
    for key in ("decode_tok_s", "output_tok_s", "tokens_per_request"):
        values = [r[key] for r in rounds if r[key] is not None]
        out[key] = median(values) if values else None
    drafted, accepted = sum(r["draft_tokens"] for r in rounds), sum(r["accepted_tokens"] for r in rounds)
    return out | {"draft_tokens": drafted, "accepted_tokens": accepted, "acceptance": accepted / drafted if drafted
                  else None, "errors": sum(r["errors"] for r in rounds)}


def _goals(clients: int, level: dict) -> list[dict]:
    out = []
    for st, entry in level.items():
        for name, x in entry["speedup"].items():
            engine, method = name.split()
            goal = GOALS.get((method, st))
            if goal is not None and clients > 1:
                goal = MANY_CLIENTS_GOAL
            if engine == "quill" and goal is not None and x is not None:
                out.append({"config": name, "set": st, "clients": clients, "speedup": x, "goal": goal,
                            "met": x >= goal})
    return out


def _fmt(v: float | None, spec: str, width: int, suffix: str = "") -> str:
    return f"{'-' if v is None else format(v, spec) + suffix:>{width}}"


def _print_level(target: str, clients: int, level: dict, rounds: int) -> None:
    key = "decode tok/s" if clients == 1 else "output tok/s"
    print(f"\n{target}, {clients} client(s): medians of {rounds} round(s); 'vs none' and 'vs llama' on {key}")
    print(f"  {'set':<5} {'server':<19} {'decode tok/s':>12} {'out tok/s':>9} {'tok/req':>7} {'accept':>7} "
          f"{'drafted':>8} {'vs none':>8} {'vs llama':>8} {'errors':>6}")
    for st, entry in level.items():
        for name, c in entry["configs"].items():
            m = c["median"]
            vs_llama = entry["quill_vs_llama_server"].get(name.split()[1]) if name.startswith("quill") else None
            print(f"  {st:<5} {name:<19} {_fmt(m['decode_tok_s'], '.1f', 12)} {_fmt(m['output_tok_s'], '.1f', 9)} "
                  f"{_fmt(m['tokens_per_request'], '.1f', 7)} {_fmt(m['acceptance'], '.2f', 7)} {m['draft_tokens']:>8} "
                  f"{_fmt(entry['speedup'].get(name), '.2f', 8, 'x')} {_fmt(vs_llama, '.2f', 8, 'x')} "
                  f"{m['errors']:>6}")
            for r in c["rounds"]:
                if r["first_error"]:
                    print(f"        {name} error: {r['first_error']}")
                    break
