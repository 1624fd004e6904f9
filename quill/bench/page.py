"""docs/BENCHMARKS.md, generated from the JSON under docs/bench/ so the page cannot drift from the runs.

    .venv/bin/python -m quill.bench.page            # rewrite docs/BENCHMARKS.md and docs/bench/vs-llamacpp.png
    .venv/bin/python -m quill.bench.page --check    # exit 1 when the committed page differs from the JSON's

``docs/bench/page.json`` names the files: per machine, a row per model and ISA (a
``quill.bench.llamacpp`` JSON) and a serving row per model and arithmetic (a ``quill bench serve``
JSON).  Every figure and every machine field on the page is read from those files; a field a file
does not record is shown as "—", never filled in.  The plot needs matplotlib (``quill[bench]``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from quill.bench import page_text
from quill.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / "docs" / "bench"
PAGE = REPO / "docs" / "BENCHMARKS.md"
NOTEBOOK = "lab/BENCHMARKS-notebook.md"  # relative to docs/

# the JSON's engine names -> the arithmetic they ran
ENGINES = {"int8-group": "quill w4a8g", "float": "quill w4a16", "llama.cpp": "llama.cpp"}
IK = "ik_llama.cpp"  # a --peer whose name starts so (its commit follows): the fork's own llama-bench
META_FIELDS = ("cpu", "cpu_family", "cores", "threads", "date", "commit", "torch", "llama_cpp")
DASH = "—"


@dataclass
class Run:
    """One comparison row read from a JSON file (or a row not measured yet: ``file`` None)."""

    model: str
    isa: str
    file: str | None
    medians: dict  # arithmetic -> {"decode_tps", "prefill_tps"}; missing arithmetic = not measured
    prompt: int | None = None
    gen: int | None = None
    best_probe: float | None = None


def load_json(name: str, bench_dir: Path) -> dict | list:
    path = bench_dir / name
    if not path.is_file():
        raise ConfigError(f"docs/bench/page.json names {name}, and {path} does not exist")
    return json.loads(path.read_text())


def split_meta(data: dict | list) -> tuple[dict, list | dict]:
    """(meta, body): a JSON of quill.bench.meta's time carries ``meta``; older ones only what they had."""
    if isinstance(data, dict) and "results" in data:
        return data.get("meta") or {}, data["results"]
    if isinstance(data, dict):
        return data.get("meta") or {}, data
    return {}, data


def recorded(meta: dict, body) -> dict:
    """The machine fields this file records, from its meta block or the top-level keys older files wrote."""
    out = {k: meta[k] for k in META_FIELDS if meta.get(k) is not None}
    top = body if isinstance(body, dict) else (body[0] if body and isinstance(body[0], dict) else {})
    cpu = top.get("cpu")
    if "cpu" not in out and isinstance(cpu, str):
        out["cpu"] = cpu
    if "cpu" not in out and isinstance(cpu, dict):  # quill bench kernels: a dict
        out["cpu"] = f"{cpu.get('model')} ({cpu.get('microarch')})"
        out.setdefault("cores", cpu.get("physical_cores"))
    m = re.search(r"(\d+) cores", out.get("cpu", ""))
    if m and "cores" not in out:  # Platform.summary() spells the core count out
        out["cores"] = int(m.group(1))
    for k in ("threads", "date", "torch"):
        if k not in out and top.get(k) is not None:
            out[k] = top[k]
    return out


def read_llamacpp_row(spec: dict, bench_dir: Path) -> tuple[Run, dict]:
    if spec.get("file") is None:
        return Run(spec["model"], spec["isa"], None, {}), {}
    meta, body = split_meta(load_json(spec["file"], bench_dir))
    results = body if isinstance(body, list) else [body]
    want = spec.get("gguf")
    picked = [r for r in results if want is None or Path(r["file"]).name == want]
    if len(picked) != 1:
        names = ", ".join(Path(r["file"]).name for r in results)
        raise ConfigError(f"{spec['file']}: expected one result for gguf={want!r}, found {len(picked)} "
                          f"(the file holds {names}); name it with \"gguf\" in page.json")
    r = picked[0]
    medians = {a: r["median"][e] for a, e in ENGINES.items() if e in r["median"]}
    iks = [e for e in r["median"] if e.startswith(IK)]
    if len(iks) > 1:
        raise ConfigError(f"{spec['file']}: more than one {IK} peer ({', '.join(iks)}); the page shows one")
    if iks:
        medians[IK] = r["median"][iks[0]]
    probes = r.get("runs", {}).get("dram_gbs") or []
    run = Run(spec["model"], spec["isa"], spec["file"], medians, r.get("prompt"), r.get("gen"),
              max(probes) if probes else None)
    return run, recorded(meta, body)


@dataclass
class ServeRow:
    model: str
    arithmetic: str
    file: str
    levels: dict  # clients -> {"quill": summary, "llama": summary}


def read_serve_row(spec: dict, bench_dir: Path, clients: tuple[int, ...] = (1, 16)) -> tuple[ServeRow, dict]:
    meta, body = split_meta(load_json(spec["file"], bench_dir))
    levels = {}
    for c in clients:
        level = body["levels"].get(str(c))
        if level and "quill serve" in level and "llama-server" in level:
            levels[c] = {"quill": level["quill serve"], "llama": level["llama-server"]}
    return ServeRow(spec["model"], spec["arithmetic"], spec["file"], levels), recorded(meta, body)


@dataclass
class Machine:
    title: str
    note: str
    notebook: str
    runs: list[Run]
    serves: list[ServeRow]
    fields: dict  # field -> {value: [files]}
    plot: bool = True  # in the plot (page.json "plot": false leaves out an older quill's machine)


def read_machine(spec: dict, bench_dir: Path) -> Machine:
    runs, serves, fields = [], [], {}

    def note(rec: dict, file: str) -> None:
        for k, v in rec.items():
            fields.setdefault(k, {}).setdefault(str(v), []).append(file)

    for row in spec["llamacpp"]:
        run, rec = read_llamacpp_row(row, bench_dir)
        runs.append(run)
        if run.file:
            note(rec, run.file)
    for row in spec.get("serve", []):
        serve, rec = read_serve_row(row, bench_dir)
        serves.append(serve)
        note(rec, serve.file)
    return Machine(spec["title"], spec.get("note", ""), spec["notebook"], runs, serves, fields,
                   spec.get("plot", True))


def read_all(bench_dir: Path = BENCH_DIR) -> tuple[dict, list[Machine]]:
    manifest = load_json("page.json", bench_dir)
    return manifest, [read_machine(m, bench_dir) for m in manifest["machines"]]


def anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def render(bench_dir: Path = BENCH_DIR) -> str:
    manifest, machines = read_all(bench_dir)
    return page_text.page(manifest, machines, NOTEBOOK, anchor)


def plot(machines: list[Machine], path: Path) -> None:
    """Decode and prefill against llama.cpp, per machine, model and ISA: one bar per arithmetic, labelled."""
    from quill.bench.report import require_matplotlib

    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{m.title.split(', ')[-1]}, {r.isa}: {r.model.split(' (')[0]}", r)
            for m in machines if m.plot for r in m.runs if "llama.cpp" in r.medians]
    shared = {label for label, _ in rows if sum(lb == label for lb, _ in rows) > 1}
    rows = [(f"{label}, prompt {r.prompt}" if label in shared and r.prompt else label, r) for label, r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.5 * len(rows) + 1.8), sharey=True)
    colours = {"int8-group": "#1f77b4", "float": "#ff7f0e"}
    labels = {"int8-group": "quill, int8-group (default for GGUF)", "float": "quill, float activations"}
    for ax, key, title in zip(axes, ("decode_tps", "prefill_tps"), ("decode", "prefill")):
        for i, arith in enumerate(("int8-group", "float")):
            for j, (_, r) in enumerate(rows):
                y = j + (i - 0.5) * 0.4
                if arith not in r.medians:
                    ax.text(0.03, y, f"{arith}: not measured", va="center", fontsize=7, color="grey")
                    continue
                x = r.medians[arith][key] / r.medians["llama.cpp"][key]
                ax.barh(y, x, height=0.38, color=colours[arith], label=labels[arith] if j == 0 else None)
                ax.text(x + 0.03, y, f"{x:.2f}x", va="center", fontsize=7,
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.3})
        ax.axvline(1.0, color="black", linewidth=1)
        ax.set_title(f"{title} (llama.cpp = 1)")
        ax.set_xlabel("quill tok/s / llama.cpp tok/s, median of the run")
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlim(0, ax.get_xlim()[1] * 1.08)
    axes[0].set_yticks(range(len(rows)), [name for name, _ in rows])
    axes[0].invert_yaxis()
    axes[1].legend(loc="lower right", fontsize=8)
    fig.suptitle("quill against llama.cpp on the same GGUF file, same ISA, 2 threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/BENCHMARKS.md differs from the JSON's page")
    ap.add_argument("--no-plot", action="store_true", help="write the page only")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if PAGE.read_text() != text:
            print(f"{PAGE} is stale: run python -m quill.bench.page", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    if not args.no_plot:
        manifest, machines = read_all()
        plot(machines, BENCH_DIR / manifest["plot"])
        print(f"wrote {BENCH_DIR / manifest['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
