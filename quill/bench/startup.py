"""``quill bench load``: model load time, first token and peak memory, quill against llama.cpp on the same files.

    quill bench load                                            # the default model
    quill bench load --model a.gguf --model ckpt_dir --runs 5 --json docs/bench/load/load.json

Every run is a fresh process.  Timed: ``LLM(model)`` after ``import torch; from quill import LLM``, and
``llama_cpp.Llama(path)`` after ``import llama_cpp`` (imports are not loading; their cost is the
baseline below).  quill runs twice over: from its prepacked cache (a directory of the bench's own,
written by one load before the timed runs) and with the cache off (``QUILL_CACHE=0``, every load
converts and repacks).  Memory: the process's resident set after loading and its high-water mark
(VmHWM, imports included), and the same for a process that only imports (the runtime's own
baseline).  Cold runs first drop the model's files and the cache's from the page cache
(``posix_fadvise`` DONTNEED); warm runs follow a run that read them.  Engines alternate; medians.
``--generate`` adds a cold ``quill generate`` of a chat question against llama-cpp-python answering
it: wall time from spawning to the first token on stdout, to exit, and peak RSS (``wait4``), beside
``python -c "import torch"``.
llama.cpp runs in its own interpreter (``--llama-python``, default ``.venv-llamacpp/bin/python``,
``make llamacpp``) with its defaults (n_ctx 512); it cannot read safetensors checkpoints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from quill.bench.stats import median
from quill.errors import ConfigError

_MEM = '''
def _mem():
    status = open("/proc/self/status").read()
    kb = lambda key: int(status.split(key + ":")[1].split()[0])
    return {"rss_mb": kb("VmRSS") / 1024, "peak_mb": kb("VmHWM") / 1024}
'''

QUILL_CHILD = _MEM + '''
import json, sys, time
import torch, quill
from quill import LLM  # the engine's modules: imported, like llama_cpp's, before the clock starts
if sys.argv[1] == "--baseline":
    print(json.dumps(_mem())); sys.exit(0)
t = time.perf_counter()
llm = LLM(sys.argv[1] or None, threads=int(sys.argv[2]), progress=False)
print(json.dumps({"load_s": time.perf_counter() - t, "hit": llm.cache_hit, **_mem()}))
'''

LLAMA_CHILD = _MEM + '''
import json, sys, time
import llama_cpp
if sys.argv[1] == "--baseline":
    print(json.dumps(_mem())); sys.exit(0)
t = time.perf_counter()
model = llama_cpp.Llama(sys.argv[1], n_threads=int(sys.argv[2]), verbose=False)
print(json.dumps({"load_s": time.perf_counter() - t, **_mem()}))
'''


def register(bsub) -> None:
    p = bsub.add_parser("load", help="model load time and peak memory, against llama.cpp on GGUF files")
    p.add_argument("--model", action="append", default=None,
                   help="a .gguf file or checkpoint directory (repeatable; default: the default model)")
    p.add_argument("--runs", type=int, default=5, help="runs per mode (cold, warm) and engine (default 5)")
    p.add_argument("--threads", type=int, default=None, help="threads (default: the usable physical cores)")
    p.add_argument("--llama-python", default=".venv-llamacpp/bin/python",
                   help="an interpreter with llama-cpp-python (make llamacpp); '' skips llama.cpp")
    p.add_argument("--generate", action="store_true",
                   help="also time a cold `quill generate` (first token, exit, peak RSS) against llama-cpp-python")
    p.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    p.set_defaults(func=run)


def drop_from_page_cache(path: Path) -> None:
    """Ask the kernel to forget the cached pages of ``path`` (a file, or every file under a directory)."""
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _child(python: str, script: str, *args: str, env: dict | None = None) -> dict:
    r = subprocess.run([python, "-c", script, *args], capture_output=True, text=True, timeout=1800, env=env)
    if r.returncode != 0:
        raise ConfigError(f"a load run failed ({python} {' '.join(args)}):\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _summary(runs: list[dict]) -> dict:
    out = {"load_s": median(r["load_s"] for r in runs), "rss_mb": median(r["rss_mb"] for r in runs),
           "peak_mb": median(r["peak_mb"] for r in runs), "runs_load_s": [round(r["load_s"], 3) for r in runs]}
    if "hit" in runs[0]:
        out["cache_hits"] = sum(bool(r["hit"]) for r in runs)
    return out


@dataclass(frozen=True)
class Engine:
    python: str
    script: str
    env: dict | None = None


def _engines(model: Path, llama_python: str | None, cache_dir: Path) -> dict[str, Engine]:
    cached = {**os.environ, "QUILL_CACHE": "1", "QUILL_CACHE_DIR": str(cache_dir)}
    engines = {"quill": Engine(sys.executable, QUILL_CHILD, cached),
               "quill, no cache": Engine(sys.executable, QUILL_CHILD, {**os.environ, "QUILL_CACHE": "0"})}
    if llama_python and model.suffix == ".gguf":
        engines["llama.cpp"] = Engine(llama_python, LLAMA_CHILD)
    return engines


def measure(model: Path, threads: int, runs: int, llama_python: str | None, cache_dir: Path) -> dict:
    """Cold and warm medians for quill from its cache, quill without it (and llama.cpp on a GGUF file)."""
    engines = _engines(model, llama_python, cache_dir)
    first = engines["quill"]
    _child(first.python, first.script, str(model), str(threads), env=first.env)  # writes the cache file
    out: dict = {}
    for mode in ("cold", "warm"):
        results: dict[str, list[dict]] = {name: [] for name in engines}
        for i in range(runs):
            order = list(engines.items())
            order = order[i % len(order):] + order[:i % len(order)]  # rotate: each engine leads in turn
            for name, e in order:
                if mode == "cold":
                    drop_from_page_cache(model)
                    drop_from_page_cache(cache_dir)
                results[name].append(_child(e.python, e.script, str(model), str(threads), env=e.env))
        out[mode] = {name: _summary(res) for name, res in results.items()}
    return out


# ---- a cold `quill generate` against llama-cpp-python answering the same chat ----------------------

QUESTION = "What is the capital of France?"
LLAMA_GENERATE = '''
import sys, llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_threads=int(sys.argv[2]), verbose=False)
for chunk in llm.create_chat_completion([{"role": "user", "content": sys.argv[3]}], max_tokens=32, stream=True,
                                        temperature=0):
    sys.stdout.write(chunk["choices"][0]["delta"].get("content") or "")
    sys.stdout.flush()
'''


def _timed_process(cmd: list[str], env: dict | None = None) -> dict:
    """Wall seconds from spawn to the first byte on stdout and to exit, and the process's peak RSS (wait4)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    first = p.stdout.read(1)
    t_first = time.perf_counter() - t0
    rest = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    t_exit = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0 or not first:
        raise ConfigError(f"{' '.join(cmd)} failed (exit {p.returncode}, output {(first + rest)[:200]!r})")
    return {"first_s": t_first, "exit_s": t_exit, "peak_mb": usage.ru_maxrss / 1024}


def measure_generate(model: Path, threads: int, runs: int, llama_python: str | None, cache_dir: Path,
                     primed: bool = False) -> dict:
    """Cold (files dropped from the page cache) runs of each, alternating; medians.  ``primed``: the cache
    file of this load is already in ``cache_dir`` (measure's first load, whose LLM defaults are generate's)."""
    quill_cmd = [sys.executable, "-m", "quill", "generate", QUESTION, "--model", str(model), "--max-tokens", "32",
                 "--threads", str(threads), "--quiet"]
    cached = {**os.environ, "QUILL_CACHE": "1", "QUILL_CACHE_DIR": str(cache_dir)}
    cmds = {"import torch": ([sys.executable, "-c", "import torch; print('x')"], None),
            "quill generate": (quill_cmd, cached),
            "quill generate, no cache": (quill_cmd, {**os.environ, "QUILL_CACHE": "0"})}
    if llama_python and model.suffix == ".gguf":
        cmds["llama-cpp-python chat"] = ([llama_python, "-c", LLAMA_GENERATE, str(model), str(threads), QUESTION],
                                         None)
    if not primed:
        _timed_process(quill_cmd, cached)  # the cache file exists before the timed runs
    results: dict[str, list[dict]] = {name: [] for name in cmds}
    for i in range(runs):
        for name, (cmd, env) in (list(cmds.items()) if i % 2 == 0 else list(cmds.items())[::-1]):
            drop_from_page_cache(model)
            drop_from_page_cache(cache_dir)
            results[name].append(_timed_process(cmd, env))
    return {name: {k: median(r[k] for r in rs) for k in ("first_s", "exit_s", "peak_mb")}
            for name, rs in results.items()}


def _print_load(m: Path, res: dict) -> None:
    print(f"\n{m.name}")
    for mode, engines in res.items():
        for name, s in engines.items():
            hits = f"  cache hits {s['cache_hits']}/{len(s['runs_load_s'])}" if name == "quill" else ""
            print(f"  {mode:<5} {name:<16} load {s['load_s']:6.3f} s  RSS after load {s['rss_mb']:6.0f} MB  "
                  f"peak {s['peak_mb']:6.0f} MB  runs {s['runs_load_s']}{hits}")
        if "llama.cpp" in engines:
            for name in ("quill", "quill, no cache"):
                print(f"  {mode:<5} ratio {name} / llama.cpp: load "
                      f"{engines[name]['load_s'] / engines['llama.cpp']['load_s']:.2f}x")


def run(args) -> int:
    from quill.default_model import default_model_path
    from quill.platform import detect

    platform = detect()
    threads = args.threads or platform.default_threads
    models = [Path(m) for m in (args.model or [str(default_model_path())])]
    for m in models:
        if not m.exists():
            raise ConfigError(f"--model: no such file or directory '{m}'")
    llama = args.llama_python or None
    if llama and not Path(llama).exists():
        raise ConfigError(f"--llama-python: no interpreter at '{llama}' (make llamacpp, or pass '' to skip)")
    report = {"cpu": platform.summary(), "threads": threads, "runs": args.runs,
              "baseline": {"quill (import torch, quill)": _child(sys.executable, QUILL_CHILD, "--baseline")},
              "models": {}, "generate": {}}
    if llama:
        report["baseline"]["llama.cpp (import llama_cpp)"] = _child(llama, LLAMA_CHILD, "--baseline")
    print(f"cpu: {platform.summary()}, {threads} threads, medians of {args.runs} runs")
    for name, b in report["baseline"].items():
        print(f"baseline {name}: RSS {b['rss_mb']:.0f} MB, peak {b['peak_mb']:.0f} MB")
    with tempfile.TemporaryDirectory(prefix="quill-bench-cache-") as tmp:
        for i, m in enumerate(models):
            cache_dir = Path(tmp) / str(i)
            res = report["models"][str(m)] = measure(m, threads, args.runs, llama, cache_dir)
            _print_load(m, res)
            if args.generate:
                g = measure_generate(m, threads, args.runs, llama, cache_dir, primed=True)  # measure's load wrote it
                report["generate"][str(m)] = g
                print(f"  cold generate ({QUESTION!r}, 32 tokens):")
                for name, r in g.items():
                    print(f"    {name:<26} first output {r['first_s']:6.3f} s  exit {r['exit_s']:6.3f} s  "
                          f"peak RSS {r['peak_mb']:6.0f} MB")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0
