"""``quill bench``: kernel benchmarks (and the checkpoint for the model-level one).

    quill bench kernels                      # all shapes, M = 1 8 32 128 512, every kernel
    quill bench kernels --quick              # 4096 x 4096 only, M = 1 and 128
    quill bench kernels --json out.json --plot out.png
    quill bench linears [CHECKPOINT]         # every quantized linear once per token (default model)
    quill bench checkpoint DIR               # write a 1B Llama-shaped W4 checkpoint (model benchmark)
    quill bench model [CHECKPOINT]           # prefill / decode / batch-8 tokens/s and % of the roofline
    quill bench moe-layer | moe-model        # one MoE layer / a small MoE model: decode and prefill
    quill bench spec [--llama-server BIN]    # speculative decoding: quill serve and llama-server
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from quill.cli.common import add_option_args
from quill.errors import ConfigError, format_choices
from quill.options import ActQuant, is_gguf
from quill.platform import detect


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark kernels against torch int4pack and dense matmul")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    k = bsub.add_parser("kernels", help="time every kernel on decode and prefill shapes")
    k.add_argument("--shapes", default=None, help="N x K list, e.g. 4096x4096,11008x4096 (default: the four)")
    k.add_argument("--m", default=None, help="token counts, e.g. 1,8,128 (default: 1,8,32,128,512)")
    k.add_argument("--kernels", default=None, help="comma-separated subset of the benchmarked kernels")
    k.add_argument("--runs", type=int, default=5, help="timed runs per cell; the median is reported")
    k.add_argument("--min-run-ms", type=float, default=40.0, help="minimum duration of one timed run")
    k.add_argument("--probe-mib", type=int, default=None, help="bandwidth probe buffer (default: 8 x L3, >= 256)")
    k.add_argument("--quick", action="store_true", help="4096x4096 only, M = 1 and 128")
    add_option_args(k, only=("threads", "isa"))  # the model commands' --threads and --isa
    k.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    k.add_argument("--plot", type=Path, default=None, help="write a PNG plot here (needs matplotlib)")
    k.set_defaults(func=run_kernels)
    lin = bsub.add_parser("linears", help="every quantized linear of a checkpoint once per token: native vs torch")
    lin.add_argument("checkpoint", nargs="?", default=None, help="checkpoint path (default: the default model)")
    lin.add_argument("--tokens", type=int, default=10, help="tokens per timed run")
    lin.add_argument("--runs", type=int, default=5, help="timed runs; the median is reported")
    add_option_args(lin, only=("activation_quant",))  # --act-quant, as for the model commands
    lin.set_defaults(func=run_linears)
    c = bsub.add_parser("checkpoint", help="write a 1B Llama-shaped 4-bit checkpoint for the model benchmark")
    c.add_argument("out", type=Path, help="output directory")
    c.add_argument("--layers", type=int, default=16)
    c.add_argument("--group-size", type=int, default=128)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--format", dest="fmt", choices=("compressed-tensors", "gptq"), default="compressed-tensors",
                   help="compressed-tensors pack-quantized (llm-compressor's W4A16) or GPTQ (v1, AutoGPTQ's)")
    c.add_argument("--tokenizer-from", type=Path, default=None,
                   help="write this checkpoint's tokenizer beside the weights (its vocabulary size is used)")
    c.set_defaults(func=run_checkpoint)
    md = bsub.add_parser("model", help="prefill, decode and batched decode of a checkpoint against the roofline")
    md.add_argument("checkpoint", nargs="?", type=Path, default=None,
                    help="checkpoint directory (default: the 1B W4 checkpoint, written to the cache on first use)")
    md.add_argument("--modes", default="w4a16,w4a8", help="activation modes: w4a16 (float), w4a8 (int8 per token), "
                    "w4a8g (int8 per token and weight group)")
    add_option_args(md, only=("dtype", "threads"))  # the model commands' --dtype and --threads
    md.add_argument("--prompt", type=int, default=512, help="prompt tokens of the prefill / decode runs")
    md.add_argument("--gen", type=int, default=128, help="tokens decoded per run")
    md.add_argument("--batch", type=int, default=8, help="prompts decoded together in the batch runs")
    md.add_argument("--runs", type=int, default=5, help="runs per mode; medians are reported")
    md.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    md.set_defaults(func=run_model)
    if len(sub.choices) > 1:
        # the whole command list (`quill --help`, quill.cli.build_parser(None)): the suites below declare
        # their options in modules that import torch, and that list shows none of them
        return
    from quill.bench import moe_args

    moe_args.register(bsub)  # moe-layer, moe-model
    from quill.bench import serve

    serve.register(bsub)  # serve: quill serve against llama-server
    from quill.bench import spec

    spec.register(bsub)  # spec: speculative decoding, quill serve and llama-server
    from quill.bench import startup

    startup.register(bsub)  # load: load time and memory against llama.cpp


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise ConfigError(f"--{what} '{text}' should be comma-separated integers") from e


def _shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        n, sep, k = part.strip().lower().partition("x")
        if not sep or not n.isdigit() or not k.isdigit():
            raise ConfigError(f"--shapes entry '{part}' should look like 4096x4096 (N x K)")
        out.append((int(n), int(k)))
    return out


def run_kernels(args) -> int:
    import torch  # here, not at the top: quill --help must not load torch

    from quill.bench import kernels as kb
    from quill.bench import memory, report

    if args.plot:
        report.require_matplotlib()  # fail before the run, not after it
    platform = detect().limited_to(args.isa)
    threads = args.threads or platform.default_threads
    torch.set_num_threads(threads)
    shapes = [(4096, 4096)] if args.quick else (_shapes(args.shapes) if args.shapes else list(kb.SHAPES))
    tokens = (1, 128) if args.quick else tuple(_ints(args.m, "m") if args.m else kb.TOKENS)
    cases = list(kb.CASES) if not args.kernels else [c.strip() for c in args.kernels.split(",")]
    unknown = [c for c in cases if c not in kb.CASES]
    if unknown:
        raise ConfigError(f"unknown benchmark kernel(s) {', '.join(unknown)}; known: {format_choices(kb.CASES)}")
    log = lambda s: print(s, flush=True)  # noqa: E731
    aten = torch.backends.cpu.get_cpu_capability()
    log(f"cpu: {platform.model_name} ({platform.microarch}), {threads} threads, torch {torch.__version__} "
        f"(ATen {aten}), native kernels: isa {args.isa}")
    if args.isa == "avx2" and aten != "AVX2":
        log(f"note: torch's kernels run {aten} here; set ATEN_CPU_CAPABILITY=avx2 to compare like for like")
    probe = args.probe_mib << 20 if args.probe_mib else None
    bw = memory.measure(platform.cache("L3") or (32 << 20), threads, nbytes=probe)
    suite = kb.Suite(platform, threads, bw)
    for line in report.bandwidth_lines(suite):
        log(line)
    for n, k in shapes:
        bw_now = memory.measure(platform.cache("L3") or (32 << 20), threads, runs=3, nbytes=probe)
        suite.shape_bandwidth[(n, k)] = bw_now.best_all
        log(f"{n} x {k}: DRAM read now {bw_now.best_all:.1f} GB/s")
        prepared = []
        for case in cases:
            try:
                prepared.append(kb.prepare_case(suite, case, n, k))
            except RuntimeError as e:  # a kernel that cannot run here is reported, not fatal
                log(f"  {case:<13} {n}x{k}: skipped: {e}")
        kb.run_shape(suite, prepared, n, k, tokens, args.runs, args.min_run_ms / 1e3, log)
        del prepared
        if "native_w4a16" in cases and "native_w4a8" in cases:
            suite.accuracy.append(kb.accuracy(n, k, platform))
    log("")
    log(report.table(suite))
    command = "quill " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if args.json:
        report.write_json(suite, args.json, command)
        log(f"wrote {args.json}")
    if args.plot:
        report.plot(suite, args.plot)
        log(f"wrote {args.plot}")
    return 0


def run_linears(args) -> int:
    from quill.bench import linears
    from quill.kernels import KernelPolicy

    if args.checkpoint is None:
        from quill.default_model import default_model_path
        args.checkpoint = default_model_path()
    policies = {"selected": KernelPolicy(), "torch": KernelPolicy(force="torch", origin="bench linears")}
    # "auto" made concrete for the file, as LLM does (a GGUF file: int8-group)
    request = ActQuant.parse(args.activation_quant).resolve(is_gguf(Path(args.checkpoint))).request
    if request == "int8-group":
        del policies["torch"]  # torch has no per-group int8 activations (it refuses them); nothing to compare
    linears.run(args.checkpoint, detect(), policies, args.tokens, args.runs, request)
    return 0


def run_checkpoint(args) -> int:
    from quill.bench.checkpoint import write_llama_w4

    path = write_llama_w4(args.out, layers=args.layers, group_size=args.group_size, seed=args.seed, fmt=args.fmt,
                          tokenizer_from=args.tokenizer_from)
    print(f"wrote {path}")
    return 0


def default_bench_checkpoint(environ=None) -> Path:
    """Where ``quill bench model`` keeps its 1B checkpoint: $XDG_CACHE_HOME (or ~/.cache)/quill/bench/llama1b-w4."""
    import os
    env = os.environ if environ is None else environ
    root = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "quill" / "bench" / "llama1b-w4"


def run_model(args) -> int:
    import json

    from quill.bench import model
    from quill.bench.checkpoint import write_llama_w4

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in model.MODES]
    if unknown or not modes:
        raise ConfigError(f"--modes '{args.modes}': supported modes are {format_choices(model.MODES)}")
    path = args.checkpoint
    if path is None:
        path = default_bench_checkpoint()
        if not (path / "config.json").exists():
            print(f"writing the 1B W4 checkpoint to {path} (once, ~1 GB)", flush=True)
            write_llama_w4(path)
    log = lambda s: print(s, flush=True)  # noqa: E731
    bench = model.run(path, detect(), modes, args.dtype, args.threads, args.prompt, args.gen, args.batch,
                      args.runs, log)
    log("")
    log(bench.table())
    if args.json:
        command = "quill " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": command, **bench.to_json()}, indent=1))
        log(f"wrote {args.json}")
    return 0
