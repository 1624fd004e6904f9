"""quill against llama.cpp on random-weight Gemma-3-1B- and gpt-oss-20b-shaped GGUF files (sliding-window
attention; gpt-oss's experts MXFP4), decode and prefill tokens/s at a short and a long prompt:
``llamacpp.py``'s comparison where the window matters.

    .venv/bin/python -m quill.bench.windowed --llama-python .venv-llamacpp/bin/python --out DIR
        [--models gemma3,gpt-oss] [--types q4_0,q4_k_m] [--prompt 128,4096] [--gen 64] [--runs 3]
        [--act-quant int8-group] [--isa avx2] [--llama-lib DIR] [--isolate auto|on|off] [--write-only]
        [--tiny] --json OUT

The files (quill.bench.windowed_gguf, written once into ``--out``): ``gemma3-1b.Q4_0.gguf`` and
``gemma3-1b.Q4_K_M.gguf`` (Gemma-3-1B's text model: hidden 1152, 26 layers of which each 6th is global, the
others a 512-token window; 4 query / 1 KV head of 256; MLP 6912; 262,144-token tied embedding: 1.0B weights),
quantized by llama.cpp from the F16 file its converter would write; ``gpt-oss-20b.MXFP4_MOE.gguf`` (hidden 2880,
24 layers alternating a 128-token window and global attention with sinks, 64 query / 8 KV heads of 64, 32
experts of 2880, 4 per token, biases, an untied 201,088-token vocabulary: 20.9B weights, 3.6B read per token),
written directly as llama.cpp's MXFP4_MOE quantization leaves a converted checkpoint (~12 GB).

Each ``--prompt`` length is one comparison per file: the prompt (fixed token ids) prefilled, then ``--gen``
tokens decoded after it, ``--runs`` rounds alternating the engines, medians reported (llamacpp.compare).
quill runs ``--act-quant`` (default int8-group: llama.cpp's arithmetic), never with its prepacked cache (a 12 GB
file would be packed and cached again: ``cache=False``), and without a tokenizer (the prompt is token ids).

Memory: quill holds a loaded file's weights in its own memory (its kernels' layouts) while llama.cpp maps the
same file (MAP_POPULATE: the whole file in the page cache).  For gpt-oss-20b that does not fit 24 GB: quill's
resident memory after loading it is 12.1-12.4 GB (anonymous; the load peaks at 20.9 GB of RSS, the file's
pages mapped while they are repacked), llama.cpp's mapping another 12.1 GB, and llama.cpp would then decode
from a file the page cache keeps evicting.  ``--isolate`` runs each engine in its own process, one after the
other, in every round (quill loads, warms up and runs once, then exits; llama.cpp runs in its own process
anyway); load times are never in the rates.  ``auto`` (default) isolates when twice the file is more than 0.8
of the available memory (gpt-oss-20b on 24 GB; not Gemma, nor the tiny files).  Each isolated quill run
reports its resident memory after loading (``quill_rss_after_load`` in the JSON).

``--tiny`` writes test-size files in seconds (quill.bench.windowed_gguf.TINY).  The JSON is llamacpp.py's
(``{"meta", "results"}``), each result with its ``model``, ``shape`` and weight counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from quill.bench.llamacpp import (
    add_modes_arg,
    bench_setup,
    compare,
    file_linear_bytes,
    parse_modes,
    report,
    run_llamacpp,
)
from quill.bench.windowed_gguf import GEMMA3_TYPES, SHAPES, weight_counts, write_models

# every quill load here: no prepacked cache (neither read nor written), no tokenizer (token-id prompts)
LLM_OPTIONS = {"cache": False, "skip_tokenizer_init": True}

QUILL_SCRIPT = r"""
import json, sys
from quill.bench.windowed import quill_once
print(json.dumps(quill_once(**json.loads(sys.argv[1]))))
"""


def quill_once(path: str, prompt: int, gen: int, threads: int, activation_quant: str, isa: str,
               kv_cache_dtype: str) -> dict:
    """One isolated quill run (in its own process): load, warm up, prefill ``prompt`` and decode ``gen`` tokens;
    the rates, the resident memory after loading and the weight bytes the kernels hold."""
    import quill
    from quill.bench.llamacpp import quill_linear_bytes, run_quill
    from quill.engine.core import EngineConfig
    from quill.engine.memory import rss_bytes
    from quill.platform import detect

    platform = detect()
    if isa == "avx2":
        platform = platform.limited_to("avx2")
    cfg = EngineConfig(enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    llm = quill.LLM(path, threads=threads, progress=False, activation_quant=activation_quant, platform=platform,
                    engine_config=cfg, **LLM_OPTIONS)
    rss = rss_bytes()
    run_quill(llm, 8, 4)  # warm-up, as compare() does once per engine
    return {**run_quill(llm, prompt, gen), "rss_after_load": rss, "held": quill_linear_bytes(llm)}


def run_quill_isolated(path: Path, prompt: int, gen: int, threads: int, activation_quant: str, isa: str,
                       kv_cache_dtype: str) -> dict:
    import quill

    # the child imports the quill this process runs (a worktree's, not whatever the interpreter would find)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(quill.__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]))
    args = dict(path=str(path), prompt=prompt, gen=gen, threads=threads, activation_quant=activation_quant, isa=isa,
                kv_cache_dtype=kv_cache_dtype)
    p = subprocess.run([sys.executable, "-c", QUILL_SCRIPT, json.dumps(args)], capture_output=True, text=True,
                       check=False, env=env)
    if p.returncode:
        raise RuntimeError(f"quill run on {path.name} failed: {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def compare_isolated(path: Path, python: str, prompt: int, gen: int, runs: int, threads: int, probe, log,
                     isa: str, lib: Path | None, kv_cache_dtype: str, modes: dict) -> dict:
    """compare()'s rounds and result, each engine in its own process: never two copies of the weights at once."""
    engines = (*modes, "llama.cpp")
    rows: dict[str, list] = {e: [] for e in engines} | {"dram_gbs": [], "compute_gflops": []}
    held, rss = 0, []
    for r in range(runs):
        rows["dram_gbs"].append(probe.read_gbs())
        rows["compute_gflops"].append(probe.compute_gflops())
        for e, aq in modes.items():
            got = run_quill_isolated(path, prompt, gen, threads, aq, isa, kv_cache_dtype)
            held = got.pop("held")
            rss.append(got.pop("rss_after_load"))
            rows[e].append(got)
        rows["llama.cpp"].append(run_llamacpp(python, path, prompt, gen, threads, lib))
        log(f"  run {r + 1}/{runs}: DRAM {rows['dram_gbs'][-1]:.1f} GB/s, compute {rows['compute_gflops'][-1]:.0f} "
            f"GFLOP/s; quill RSS after load {rss[-1] / 1e9:.2f} GB; "
            "decode tok/s: " + ", ".join(f"{e} {rows[e][-1]['decode_tps']:.1f}" for e in engines))
    med = {e: {k: statistics.median(r[k] for r in rows[e]) for k in ("prefill_tps", "decode_tps")}
           for e in engines}
    return {"file": str(path), "prompt": prompt, "gen": gen, "threads": threads, "kv_cache_dtype": kv_cache_dtype,
            "runs": rows, "median": med, "quill_weight_bytes_per_token": held,
            "file_weight_bytes": file_linear_bytes(path), "isolated": True, "quill_rss_after_load": max(rss)}


def available_bytes() -> int:
    """MemAvailable (Linux), else 0: then ``auto`` isolates every file."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def should_isolate(path: Path, mode: str) -> bool:
    if mode != "auto":
        return mode == "on"
    return 2 * path.stat().st_size > 0.8 * available_bytes()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-python", required=True, help="python of a virtualenv with llama-cpp-python")
    ap.add_argument("--out", type=Path, required=True, help="where the GGUF files are written (once)")
    ap.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated: {', '.join(SHAPES)}")
    ap.add_argument("--types", default=",".join(GEMMA3_TYPES),
                    help="llama.cpp ftypes Gemma is quantized into (gpt-oss is MXFP4_MOE)")
    ap.add_argument("--tiny", action="store_true", help="test-size shapes")
    ap.add_argument("--keep-f16", action="store_true", help="keep Gemma's F16 file the quantizer reads")
    ap.add_argument("--write-only", action="store_true", help="write the files, run nothing")
    add_modes_arg(ap, "int8-group")
    ap.add_argument("--prompt", default="128,4096", help="comma-separated prompt lengths, one comparison each")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--isa", choices=("native", "avx2"), default="native", help="quill's (and torch's) ISA")
    ap.add_argument("--llama-lib", type=Path, default=None, help="directory of a native libllama.so to run")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto")
    ap.add_argument("--isolate", choices=("auto", "on", "off"), default="auto",
                    help="each engine in its own process per round (auto: when the file is too large for both)")
    args = ap.parse_args(argv)
    args.model_list = [m for m in args.models.split(",") if m]
    args.modes = parse_modes(ap, args.act_quant)
    if bad := set(args.model_list) - set(SHAPES):
        ap.error(f"unknown model(s) {', '.join(sorted(bad))}; known: {', '.join(SHAPES)}")
    try:
        args.prompts = [int(p) for p in args.prompt.split(",") if p]
    except ValueError:
        ap.error(f"--prompt: comma-separated integers, found {args.prompt!r}")
    if not args.prompts or min(args.prompts) < 1:
        ap.error(f"--prompt: positive lengths, found {args.prompt!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.isa == "avx2":  # before torch is imported (isolated quill runs inherit it)
        os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
    from quill.engine.hub import default_model

    files = write_models(args.out, args.model_list, args.types.split(","), args.llama_python, default_model(),
                         args.tiny, args.keep_f16)
    if args.write_only:
        return 0
    platform, threads, probe = bench_setup(args)
    results = []
    for f, shape in files:
        counts = weight_counts(shape)
        isolated = should_isolate(f, args.isolate)
        for prompt in args.prompts:
            print(f"{f.name}: {counts['weights'] / 1e9:.2f}B weights ({counts['weights_per_token'] / 1e9:.2f}B read "
                  f"per token); prompt {prompt}, {args.gen} decoded, {threads} threads"
                  f"{'; each engine in its own process' if isolated else ''}", flush=True)
            if isolated:
                res = compare_isolated(f, args.llama_python, prompt, args.gen, args.runs, threads, probe, print,
                                       args.isa, args.llama_lib, args.kv_cache_dtype, args.modes)
            else:
                res = compare(f, args.llama_python, prompt, args.gen, args.runs, threads, probe, print, platform,
                              args.llama_lib, args.kv_cache_dtype, modes=args.modes, llm_options=LLM_OPTIONS)
            model = next(m for m, s in SHAPES.items() if s.arch == shape.arch)
            results.append({**res, "model": model, "shape": asdict(shape), **counts})
    report(results, args, platform, threads, "python -m quill.bench.windowed", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
