"""The Markdown of docs/BENCHMARKS.md: figures from :mod:`quill.bench.page`'s readers, prose that explains them."""

from __future__ import annotations

DASH = "—"

HEAD = """# Benchmarks

quill against llama.cpp on the same GGUF file, and `quill serve` against `llama-server`, on the CPUs
measured so far; generated from the JSON in [docs/bench/](bench/) (named in `docs/bench/page.json`) by
`python -m quill.bench.page`, and a test checks the committed page against it. Every run and what was
tried and dropped: [the lab notebook]({nb}). quill runs GGUF in two arithmetics, both shown:

* **int8-group** (the default for GGUF; `--act-quant int8-group`): activations quantized to int8 with
  one scale per token and weight group, as llama.cpp's own matmuls do; llama.cpp's accuracy (mean KL
  0.003 from the float32 forward on the default model, [ACCURACY.md](ACCURACY.md)).
* **float activations** (`--act-quant none`): within 1e-5 KL of the float32 forward, slower where a run
  is compute-bound (prefill, and decode of larger models on AVX2).

Cells are tok/s, with quill's ratio to llama.cpp in the same run in brackets (above 1: quill faster).
"—" means not measured or, in a machine's first table, not recorded in that machine's JSON.

![quill / llama.cpp, decode and prefill, per machine, model and ISA]({plot})
"""

METHOD = """## Method

* Same GGUF file, same thread count (2: each machine is a 2-core VM), same ISA for both engines:
  AVX-512 rows run llama.cpp built from its sources with `GGML_NATIVE` (without AMX where it crashed),
  AVX2 rows run quill's AVX2 kernels (`--isa avx2`, `ATEN_CPU_CAPABILITY=avx2`) against llama.cpp's AVX2 wheel.
* A prompt of fixed token ids, then greedy decoding (the tokens column); no prefix cache. llama.cpp runs
  through llama-cpp-python in its own virtualenv, a fresh process per run. The engines alternate run by
  run, 3-5 runs, medians: on shared hosts alternating keeps a ratio fair while the absolute rates move.
* Before each run a probe reads 8 x L3 from DRAM with every thread; a run's roofline is the highest
  bandwidth any of its probes read (the "best probe" column), which decode of 1B+ models races for.
* Serving: closed-loop clients, each sending its next streamed `/v1/completions` when the last one
  finished; prompts of 48-192 random English words, 32-128 output tokens, greedy, `ignore_eos`; rounds
  alternate the servers, medians. llama-server gets continuous batching and one slot per client. Output
  tok/s: generated tokens over the round's wall time; ITL measured at the client, on the same 2 cores.
"""

COMMANDS = """## Commands

The commands behind the tables (each machine's notebook section has the exact ones it ran):

```
make llamacpp       # llama-cpp-python 0.3.36 into .venv-llamacpp: llama.cpp's quantizer and AVX2 peer
B=".venv/bin/python -m quill.bench.llamacpp --llama-python .venv-llamacpp/bin/python --runs 3"
# AVX-512 rows add --llama-lib LL (a GGML_NATIVE, BUILD_SHARED_LIBS llama.cpp build's bin/), AVX2 rows --isa avx2
$B --write-1b /work/gguf --write-8b /work/gguf --json docs/bench/MACHINE/q40.json    # Q4_0, random weights
$B --gguf /work/gguf/llama-1b-q4_0.gguf --types q4_k_m --json ...   # Q4_K_M: llama.cpp requantizes the Q4_0 file
# Qwen3.5-, Gemma-3-1B- and gpt-oss-20b-shaped files: python -m quill.bench.qwen35 | quill.bench.windowed --out DIR
# serving (LS: llama-server, same build); float: --serve-arg=--act-quant --serve-arg=none; --json-schema FILE
.venv/bin/quill bench serve --llama-server $LS --clients 1,16 --rounds 3 --json docs/bench/MACHINE/serve-NAME.json
.venv/bin/python -m quill.bench.page   # after naming the JSON in docs/bench/page.json
```

Kernel, model-level, MoE and load-time benchmarks (`quill bench kernels | model | moe-layer | load`)
and where each lives: [quill/bench/README.md](../quill/bench/README.md); their figures are in the notebook.
"""

LIMITS = """## Known limits

* Two cores, shared hosts: rates move with the neighbours (the DRAM probe ranges); compare ratios within
  a row. Decode ratios of the larger files follow the DRAM's state: at a low probe both wait on memory.
* Q4_K_M on AVX2: prefill 1.45-1.51x llama.cpp but 0.85-0.88x ik_llama.cpp (Zen 4, `--isa avx2`; Zen 3 rows
  predate llama.cpp's K-quant arithmetic: 0.87-0.91x llama.cpp). quill's 4-bit tile issues about 3.1 vector
  instructions per multiply against ik_llama.cpp's 3.4 yet runs 1.2 of the core's 2 multiplies a cycle
  (notebook, thirty-first session).
* Float activations: two int8 products per weight (`exact`: three; rows before the 21st session), llama.cpp's one:
  float prefill on Sapphire Rapids, 1.2B, prompt 128, 1.28x llama.cpp (exact 0.94x), `--isa avx2` 0.80x (0.62x).
* The shaped files (1.2B, 8B, Qwen3.5, Gemma 3, gpt-oss) have random weights: speed does not depend on them.
* The JSON-schema serving rows hold every request to one schema (64+ list items, so no request ends
  before its token count); the free rows are a separate run minutes apart, not alternated with them.
* 8B decode on Zen 4 follows the DRAM probe. Zen 5 rows (an older quill, sixth to tenth sessions): the notebook.
"""


def tps(v: float, digits: int) -> str:
    return f"{v:.{digits}f}"


def cell(run, arith: str) -> str:
    """'decode (ratio) / prefill (ratio)' of one arithmetic, or a dash."""
    m, lc = run.medians.get(arith), run.medians.get("llama.cpp")
    if m is None or lc is None:
        return DASH
    if arith == "llama.cpp":
        return f"{tps(m['decode_tps'], 1)} / {tps(m['prefill_tps'], 0)}"
    return (f"{tps(m['decode_tps'], 1)} ({m['decode_tps'] / lc['decode_tps']:.2f}x) / "
            f"{tps(m['prefill_tps'], 0)} ({m['prefill_tps'] / lc['prefill_tps']:.2f}x)")


def ik_cell(run) -> str:
    """ik_llama.cpp's 'decode / prefill' and quill int8-group's ratio to it, or a dash (not run beside quill)."""
    ik, q = run.medians.get("ik_llama.cpp"), run.medians.get("int8-group")
    if ik is None or q is None:
        return DASH
    return (f"{tps(ik['decode_tps'], 1)} / {tps(ik['prefill_tps'], 0)} (quill {q['decode_tps'] / ik['decode_tps']:.2f}x"
            f" / {q['prefill_tps'] / ik['prefill_tps']:.2f}x)")


def llamacpp_table(machine) -> list[str]:
    ik = any("ik_llama.cpp" in r.medians for r in machine.runs)
    peer = ["ik_llama.cpp (-rtr 1), quill int8-group's ratio"] if ik else []
    head = ["model", "ISA", "tokens (prompt + decoded)", "quill, int8-group (default for GGUF)",
            "quill, float activations", "llama.cpp", *peer, "best probe GB/s", "JSON"]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in machine.runs:
        if r.file is None:
            missing = " | ".join(["not measured"] * (4 if ik else 3))
            out.append(f"| {r.model} | {r.isa} | {DASH} | {missing} | {DASH} | {DASH} |")
            continue
        probe = DASH if r.best_probe is None else f"{r.best_probe:.0f}"
        peer = f" {ik_cell(r)} |" if ik else ""
        out.append(f"| {r.model} | {r.isa} | {r.prompt} + {r.gen} | {cell(r, 'int8-group')} | {cell(r, 'float')} | "
                   f"{cell(r, 'llama.cpp')} |{peer} {probe} | [{r.file}](bench/{r.file}) |")
    return out


ARITH = {"int8-group": "int8-group (default for GGUF)", "float": "float activations"}


def serve_table(machine) -> list[str]:
    out = ["| model | quill arithmetic | clients | quill out tok/s | llama-server out tok/s | ratio | "
           "ITL p99 ms, quill / llama-server | JSON |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in machine.serves:
        for clients, lv in sorted(s.levels.items()):
            q, ll = lv["quill"], lv["llama"]
            out.append(f"| {s.model} | {ARITH[s.arithmetic]} | {clients} | {q['output_tok_s']:.1f} | "
                       f"{ll['output_tok_s']:.1f} | {q['output_tok_s'] / ll['output_tok_s']:.2f}x | "
                       f"{q['itl_p99_ms']:.0f} / {ll['itl_p99_ms']:.0f} | [{s.file}](bench/{s.file}) |")
    return out


FIELDS = (("cpu", "CPU (model, microarchitecture, cores / threads, ISA)"), ("cpu_family", "CPUID family / model"),
          ("cores", "cores"), ("threads", "threads per engine"), ("date", "date"), ("commit", "quill commit"),
          ("torch", "torch"), ("llama_cpp", "llama.cpp"))


def field_value(machine, key: str) -> str:
    values = machine.fields.get(key, {})
    return "; ".join(values) if values else DASH


def field_sources(machine) -> str:
    """Which files record a field that not every file of the machine records (the rest show it as a dash)."""
    files = {r.file for r in machine.runs if r.file} | {s.file for s in machine.serves}
    notes = {}
    for key, name in FIELDS:
        covered = {f for where in machine.fields.get(key, {}).values() for f in where}
        if covered and covered != files:
            notes.setdefault(", ".join(sorted(covered)), []).append(name.split(" (")[0])
    return " ".join(f"{' and '.join(names)}: recorded by {where} only." for where, names in notes.items())


def machine_table(machine) -> list[str]:
    probes = [r.best_probe for r in machine.runs if r.best_probe is not None]
    probe = f"{min(probes):.0f}-{max(probes):.0f} GB/s" if probes else DASH
    names = [name for _, name in FIELDS] + ["DRAM probe (best of each run)"]
    cells = [field_value(machine, key) for key, _ in FIELDS] + [probe]
    out = ["| " + " | ".join(names) + " |", "|" + " --- |" * len(names), "| " + " | ".join(cells) + " |"]
    sources = field_sources(machine)
    return out + (["", sources] if sources else [])


def machine_section(machine, notebook: str, anchor) -> list[str]:
    link = f"[notebook: {machine.notebook}]({notebook}#{anchor(machine.notebook)})"
    out = [f"## {machine.title}", "", f"{machine.note} Detail: {link}.", "",
           *machine_table(machine), "",
           "### Against llama.cpp, same GGUF file (decode / prefill tok/s)", "", *llamacpp_table(machine)]
    if machine.serves:
        out += ["", "### Serving: `quill serve` against `llama-server`, 1 and 16 clients", "", *serve_table(machine)]
    return out + [""]


def page(manifest: dict, machines: list, notebook: str, anchor) -> str:
    lines = [HEAD.format(nb=notebook, plot=f"bench/{manifest['plot']}")]
    for m in machines:
        lines += machine_section(m, notebook, anchor)
    lines += [METHOD, COMMANDS, LIMITS.rstrip("\n"), ""]
    return "\n".join(lines)
