"""Build quill's native kernels: ``python -m quill.native.build`` (run by ``make install`` / ``make demo``).

Plain g++, outside pip (pip's build isolation would pull a CUDA torch).  Every
ISA variant is its own translation units with their own ``-m`` flags and no
``-march=native``; only the variants this CPU runs are compiled (decided by
``quill.platform.detect`` and ``quill.native.variant_status``, the same rule that
picks the variant at load), plus the scalar twins.  ``backends.cpp`` gets one
``-DQUILL_BUILT_<ISA>`` per compiled variant and fills the ISA backend table
(``csrc/isa.h``) with them.  Only the binding files (``TORCH_SOURCES``) see torch
headers (the slow ones), compiled together as one translation unit; the kernels are
plain C++.  Objects are rebuilt when a source or header is newer or the command
changed; an unchanged tree links nothing.  ``--best`` (``make demo``) compiles only
this CPU's best variant (AVX-512 hosts skip the AVX2 one, a third of the build)
and keeps any other already compiled; ``--isa avx2`` then needs the full build
(``make native``), and the native kernels say so where they refuse.

On failure the log goes to ``quill/native/_build/build.log``, a one-line reason
to ``_build/error.txt`` (which ``quill info`` shows), any stale extension is
removed, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from quill.native import variant_status
from quill.platform import detect

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
BUILD = HERE / "_build"
EXT_NAME = "_quill_native"

# -fno-trapping-math: no result changes (IEEE non-stop arithmetic is what runs anyway); it lets the
# vectoriser turn float compares and selects (clamps, masks) into vector code
COMMON = ["-O3", "-std=c++20", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off", "-fno-trapping-math", "-Wall",
          "-Wno-unused-function"]
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
AVX512 = AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512vl"]

# ISA variant -> its translation units and their -m flags (the variant's names as quill.native.ISAS)
VARIANT_SOURCES: dict[str, dict[str, list[str]]] = {
    "avx512": {"avx512_vnni.cpp": AVX512 + ["-mavx512vnni"], "avx512_split.cpp": AVX512 + ["-mavx512vnni"],
               "avx512_quant.cpp": AVX512,
               "dense_avx512.cpp": AVX512, "attention_avx512.cpp": AVX512, "deltanet_avx512.cpp": AVX512,
               "mxfp4_avx512.cpp": AVX512 + ["-mavx512vnni"]},
    "avx2": {"avx2.cpp": AVX2, "avx2_quant.cpp": AVX2, "dense_avx2.cpp": AVX2, "attention_avx2.cpp": AVX2,
             "deltanet_avx2.cpp": AVX2, "mxfp4_avx2.cpp": AVX2},
    "scalar": {"scalar.cpp": [], "dense_scalar.cpp": [], "attention_scalar.cpp": [], "deltanet_scalar.cpp": [],
               "mxfp4_scalar.cpp": []},
}
# every build: stream builders, huge pages, the backend table (its -D flags name the variants compiled)
PLAIN_SOURCES = ("stream.cpp", "hugepage.cpp", "backends.cpp")
# The slow ones: they see torch headers.  One translation unit includes them all (GLUE, written into _build):
# they instantiate the same torch and pybind11 templates, which one TU does once (g++ 12 on Zen 3: 38 CPU
# seconds against ~180 for nine TUs with a precompiled header); an edit to any of them recompiles all nine.
TORCH_SOURCES = ("binding.cpp", "linear.cpp", "ops.cpp", "dense.cpp", "attention.cpp", "step.cpp", "moe.cpp",
                 "deltanet.cpp", "mxfp4.cpp")
GLUE = "torch_glue.cpp"
# Compiler CPU seconds per TU (g++ 12; Zen 3, the AVX-512 ones on Sapphire Rapids), to start the longest first.
COST = {"avx512_split.cpp": 90, "avx2.cpp": 58, GLUE: 57, "avx512_vnni.cpp": 43, "attention_scalar.cpp": 12,
        "attention_avx2.cpp": 11, "attention_avx512.cpp": 11, "dense_scalar.cpp": 9}


def sources(variants: list[str]) -> dict[str, list[str]]:
    """Translation unit -> its ISA flags, for a build of ``variants`` (the scalar twins always)."""
    out = {name: [] for name in PLAIN_SOURCES}
    for v in dict.fromkeys([*variants, "scalar"]):
        out.update(VARIANT_SOURCES[v])
    out["backends.cpp"] = [f"-DQUILL_BUILT_{v.upper()}" for v in VARIANT_SOURCES if v in variants and v != "scalar"]
    return out | {GLUE: []}


def _glue() -> Path:
    """The torch sources as one translation unit (rewritten only when the list changes: its mtime is an input)."""
    path = BUILD / GLUE
    text = "// written by quill/native/build.py: the torch-facing sources as one translation unit\n"
    text += "".join(f'#include "{CSRC / name}"\n' for name in TORCH_SOURCES)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def extension_path() -> Path:
    return HERE / (EXT_NAME + sysconfig.get_config_var("EXT_SUFFIX"))


def _torch_flags() -> tuple[list[str], list[str]]:
    """(compile flags of the torch TUs, link flags), cached in _build per installed torch: importing
    torch takes seconds, and an unchanged rebuild should not."""
    spec = importlib.util.find_spec("torch")
    key = f"{importlib.metadata.version('torch')} {spec and spec.origin}"
    cache = BUILD / "torch_flags.json"
    try:
        cached = json.loads(cache.read_text())
        if cached["key"] == key:
            return cached["cflags"], cached["ldflags"]
    except (OSError, ValueError, KeyError):
        pass
    import torch
    from torch.utils.cpp_extension import include_paths, library_paths

    inc = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -fopenmp: at::parallel_for is inline code around `#pragma omp parallel`; without the
    # flag it silently runs serially.  The runtime is torch's own libgomp.so.1 (same soname,
    # already loaded by torch, rpath first), so there is one thread pool, not two.
    # QUILL_TORCH names the torch whose headers the objects saw: another torch changes the commands.
    cflags = inc + [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_API_INCLUDE_EXTENSION_H",
                    f"-DTORCH_EXTENSION_NAME={EXT_NAME}", f"-DQUILL_TORCH={torch.__version__}",
                    "-Wno-unused-variable", "-fopenmp"]
    libdirs = library_paths()
    ldflags = [f"-L{d}" for d in libdirs] + [f"-Wl,-rpath,{d}" for d in libdirs]
    ldflags += ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-fopenmp"]
    cache.write_text(json.dumps({"key": key, "cflags": cflags, "ldflags": ldflags}))
    return cflags, ldflags


def _command(cxx: str, src: Path, obj: Path, flags: list[str]) -> list[str]:
    # -MMD: the headers the TU includes, in obj.d, so a header edit rebuilds only its includers
    return [cxx, *COMMON, *flags, "-MMD", "-c", str(src), "-o", str(obj)]


def _includes(obj: Path, headers: list[Path]) -> list[Path]:
    """quill's headers ``obj`` was compiled from (its -MMD file), or all of them before the first build."""
    try:
        deps = obj.with_suffix(".d").read_text().replace("\\\n", " ").split()
    except OSError:
        return headers
    deps = set(deps)
    return [h for h in headers if str(h) in deps]


def _stamp(out: Path) -> Path:
    return BUILD / (out.name + ".cmd")  # the command that made ``out``


def _stale(cmd: list[str], out: Path, inputs: list[Path]) -> bool:
    """Rebuild when ``out`` is missing, older than an input, or was built with another command."""
    stamp = _stamp(out)
    if not out.exists() or not stamp.exists() or stamp.read_text() != " ".join(cmd):
        return True
    t = out.stat().st_mtime
    return any(p.stat().st_mtime > t for p in inputs)


def _run(cmd: list[str], out: Path) -> tuple[str, int, str, float]:
    """(command, exit status, compiler output, wall seconds); ``out``'s command stamp is written on success."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode == 0:
        _stamp(out).write_text(" ".join(cmd))
    return " ".join(cmd), p.returncode, p.stdout + p.stderr, time.perf_counter() - t0


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if "error" in line.lower():
            return line.strip()[:300]
    return (log.strip().splitlines() or ["unknown error"])[-1][:300]


def native_variants() -> list[str]:
    """The ISA variants this CPU runs, best first (the same rule as quill.native.isa_for, no torch import)."""
    return [name for name, why in variant_status(detect()).items() if why is None]


def best_variants() -> list[str]:
    """This CPU's best variant, and any other it runs whose objects are already compiled (a later --best build
    does not drop what a full one made)."""
    runs = native_variants()
    return [v for i, v in enumerate(runs)
            if i == 0 or all((BUILD / (Path(n).stem + ".o")).exists() for n in VARIANT_SOURCES[v])]


@dataclass
class _Job:
    cmd: list[str]
    out: Path


def _source_name(cmd: list[str]) -> str:
    return Path(cmd[cmd.index("-c") + 1] if "-c" in cmd else cmd[-3]).name


def _compile_all(jobs: list[_Job], workers: int, verbose: bool, log: list[str]) -> None:
    """Run the compiles on ``workers`` threads in the order given; raises RuntimeError at the first failure
    (compiles not yet started are dropped)."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_run, j.cmd, j.out) for j in jobs]
        for fut in as_completed(futures):
            cmd, rc, out, secs = fut.result()
            log.append(f"$ {cmd}\n{out}")
            if verbose:
                print(f"compiled {_source_name(cmd.split())} in {secs:.1f} s" + (f"\n{out}" if out else ""), flush=True)
            if rc:
                pool.shutdown(wait=True, cancel_futures=True)
                raise RuntimeError(_first_error(out) + "\n" + "\n".join(log))


def build(jobs: int | None = None, verbose: bool = False, variants: list[str] | None = None) -> Path:
    """Compile ``variants`` (default: the ones this CPU runs; scalar always) and link the extension when
    anything changed; returns its path or raises RuntimeError with the first error."""
    BUILD.mkdir(exist_ok=True)
    (BUILD / "error.txt").unlink(missing_ok=True)
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"C++ compiler '{cxx}' not found (set CXX or install g++)")
    variants = native_variants() if variants is None else variants
    torch_cflags, ldflags = _torch_flags()
    included = sorted(CSRC.glob("*.h")) + [CSRC / name for name in TORCH_SOURCES]  # what -MMD may list
    srcs = sources(variants)
    todo = []
    for name, flags in srcs.items():
        src, obj = (_glue() if name == GLUE else CSRC / name), BUILD / (Path(name).stem + ".o")
        cmd = _command(cxx, src, obj, flags + (torch_cflags if name == GLUE else []))
        if _stale(cmd, obj, [src, *_includes(obj, included)]):
            todo.append(_Job(cmd, obj))
    todo.sort(key=lambda j: -COST.get(_source_name(j.cmd), 5))  # the longest first: none runs alone at the end
    log: list[str] = []
    _compile_all(todo, jobs or os.cpu_count() or 1, verbose, log)
    target = extension_path()
    objs = [BUILD / (Path(n).stem + ".o") for n in srcs]
    link = [cxx, "-shared", *map(str, objs), "-o", str(target), *ldflags]
    if _stale(link, target, objs):
        tmp = target.with_suffix(".tmp.so")
        _, rc, out, _ = _run([cxx, "-shared", *map(str, objs), "-o", str(tmp), *ldflags], target)
        log.append(f"$ {' '.join(link)}\n{out}")
        if rc:
            raise RuntimeError(_first_error(out) + "\n" + "\n".join(log))
        tmp.replace(target)  # atomic: a process loading the extension sees the old or the new one
        _stamp(target).write_text(" ".join(link))
        (BUILD / "build.log").write_text("\n".join(log))
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-j", "--jobs", type=int, default=None, help="parallel compiles (default: all CPUs)")
    ap.add_argument("-v", "--verbose", action="store_true", help="each compile with its wall time, and CPU totals")
    ap.add_argument("--best", action="store_true",
                    help="only the best variant this CPU runs (and the scalar twins), keeping others already built: "
                         "what running needs (make demo); --isa avx2 on an AVX-512 CPU needs the full build")
    ap.add_argument("--variants", default=None,
                    help="comma-separated ISA variants to compile, e.g. avx512,avx2 (default: the ones this CPU runs; "
                         f"known: {', '.join(VARIANT_SOURCES)}; the scalar twins always)")
    args = ap.parse_args(argv)
    variants = None if args.variants is None else [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.best:
        variants = best_variants()
    if variants is not None and (unknown := sorted(set(variants) - set(VARIANT_SOURCES))):
        ap.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANT_SOURCES)}")
    t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        path = build(args.jobs, args.verbose, variants)
    except (RuntimeError, OSError, ImportError) as e:
        first, _, rest = str(e).partition("\n")
        BUILD.mkdir(exist_ok=True)
        (BUILD / "build.log").write_text(rest or first)
        (BUILD / "error.txt").write_text(first)
        extension_path().unlink(missing_ok=True)
        print(f"quill native build failed: {first}\n(full log: {BUILD / 'build.log'}); "
              "quill still runs on the torch and reference kernels", file=sys.stderr)
        return 1
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = f"; compiler CPU {r1.ru_utime - r0.ru_utime:.1f} s user + {r1.ru_stime - r0.ru_stime:.1f} s sys"
    names = dict.fromkeys([*(native_variants() if variants is None else variants), "scalar"])
    print(f"quill native kernels built: {path.name} ({', '.join(names)}) "
          f"in {time.perf_counter() - t0:.1f} s" + (cpu if args.verbose else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
