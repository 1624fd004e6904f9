"""``quill bench load``: model load time and peak memory, quill against llama.cpp on the same files.

    quill bench load                                            # the default model
    quill bench load --model a.gguf --model ckpt_dir --runs 5 --json docs/bench/load/load.json

Every run is a fresh process.  Timed: ``quill.LLM(model)`` after ``import torch, quill``, and
``llama_cpp.Llama(path)`` after ``import llama_cpp`` (imports are not loading; their cost is the
baseline below).  Memory: the process's resident set after loading and its high-water mark
(VmHWM, imports included), and the same for a process that only imports (the runtime's own
baseline).  Cold runs first drop the model's files from the page cache (``posix_fadvise``
DONTNEED); warm runs follow a run that read them.  quill and llama.cpp runs alternate; medians.
llama.cpp runs in its own interpreter (``--llama-python``, default ``.venv-llamacpp/bin/python``,
``make llamacpp``) with its defaults (n_ctx 512); it cannot read safetensors checkpoints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
if sys.argv[1] == "--baseline":
    print(json.dumps(_mem())); sys.exit(0)
t = time.perf_counter()
llm = quill.LLM(sys.argv[1] or None, threads=int(sys.argv[2]), progress=False)
print(json.dumps({"load_s": time.perf_counter() - t, **_mem()}))
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
    p.add_argument("--threads", type=int, default=None, help="threads (default: physical cores)")
    p.add_argument("--llama-python", default=".venv-llamacpp/bin/python",
                   help="an interpreter with llama-cpp-python (make llamacpp); '' skips llama.cpp")
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


def _child(python: str, script: str, *args: str) -> dict:
    r = subprocess.run([python, "-c", script, *args], capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise ConfigError(f"a load run failed ({python} {' '.join(args)}):\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _summary(runs: list[dict]) -> dict:
    return {"load_s": median(r["load_s"] for r in runs), "rss_mb": median(r["rss_mb"] for r in runs),
            "peak_mb": median(r["peak_mb"] for r in runs), "runs_load_s": [round(r["load_s"], 3) for r in runs]}


def measure(model: Path, threads: int, runs: int, llama_python: str | None) -> dict:
    """Cold and warm medians for quill (and llama.cpp on a GGUF file), runs alternating."""
    engines = {"quill": (sys.executable, QUILL_CHILD)}
    if llama_python and model.suffix == ".gguf":
        engines["llama.cpp"] = (llama_python, LLAMA_CHILD)
    out: dict = {}
    for mode in ("cold", "warm"):
        results: dict[str, list[dict]] = {name: [] for name in engines}
        if mode == "warm":  # one read of the file first
            _child(sys.executable, QUILL_CHILD, str(model), str(threads))
        for i in range(runs):
            order = list(engines.items()) if i % 2 == 0 else list(engines.items())[::-1]
            for name, (python, script) in order:
                if mode == "cold":
                    drop_from_page_cache(model)
                results[name].append(_child(python, script, str(model), str(threads)))
        out[mode] = {name: _summary(res) for name, res in results.items()}
    return out


def run(args) -> int:
    from quill.default_model import default_model_path
    from quill.platform import detect

    platform = detect()
    threads = args.threads or platform.physical_cores
    models = [Path(m) for m in (args.model or [str(default_model_path())])]
    for m in models:
        if not m.exists():
            raise ConfigError(f"--model: no such file or directory '{m}'")
    llama = args.llama_python or None
    if llama and not Path(llama).exists():
        raise ConfigError(f"--llama-python: no interpreter at '{llama}' (make llamacpp, or pass '' to skip)")
    report = {"cpu": platform.summary(), "threads": threads, "runs": args.runs,
              "baseline": {"quill (import torch, quill)": _child(sys.executable, QUILL_CHILD, "--baseline")},
              "models": {}}
    if llama:
        report["baseline"]["llama.cpp (import llama_cpp)"] = _child(llama, LLAMA_CHILD, "--baseline")
    print(f"cpu: {platform.summary()}, {threads} threads, medians of {args.runs} runs")
    for name, b in report["baseline"].items():
        print(f"baseline {name}: RSS {b['rss_mb']:.0f} MB, peak {b['peak_mb']:.0f} MB")
    for m in models:
        res = report["models"][str(m)] = measure(m, threads, args.runs, llama)
        print(f"\n{m.name}")
        for mode, engines in res.items():
            for name, s in engines.items():
                print(f"  {mode:<5} {name:<10} load {s['load_s']:6.3f} s  RSS after load {s['rss_mb']:6.0f} MB  "
                      f"peak {s['peak_mb']:6.0f} MB  runs {s['runs_load_s']}")
            if "llama.cpp" in engines:
                print(f"  {mode:<5} ratio quill / llama.cpp: load "
                      f"{engines['quill']['load_s'] / engines['llama.cpp']['load_s']:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0
