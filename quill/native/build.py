"""Build quill's native kernels: ``python -m quill.native.build`` (run by ``make install``).

Plain g++, outside pip (pip's build isolation would pull a CUDA torch).  Every
ISA variant is its own translation unit with its own ``-m`` flags and no
``-march=native``, so one build runs on any x86-64 and the ISA is picked at
load.  Only the binding files (``binding.cpp``, ``linear.cpp``, ``ops.cpp``, ``dense.cpp``,
``attention.cpp``, ``step.cpp``, ``moe.cpp``) see torch headers (the slow ones);
the kernels are plain C++.  Objects are rebuilt when a source or header is newer.

On failure the log goes to ``quill/native/_build/build.log``, a one-line reason
to ``_build/error.txt`` (which ``quill info`` shows), any stale extension is
removed, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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

# source -> extra flags (ISA of that translation unit only)
SOURCES: dict[str, list[str]] = {
    "stream.cpp": [],
    "hugepage.cpp": [],
    "scalar.cpp": [],
    "avx2.cpp": AVX2,
    "avx512_vnni.cpp": AVX512 + ["-mavx512vnni"],
    "dense_scalar.cpp": [],
    "dense_avx2.cpp": AVX2,
    "dense_avx512.cpp": AVX512,
    "attention_scalar.cpp": [],
    "attention_avx2.cpp": AVX2,
    "attention_avx512.cpp": AVX512,
    "binding.cpp": [],
    "linear.cpp": [],
    "ops.cpp": [],
    "dense.cpp": [],
    "attention.cpp": [],
    "step.cpp": [],
    "moe.cpp": [],
}
# the slow ones: they see torch headers
TORCH_SOURCES = ("binding.cpp", "linear.cpp", "ops.cpp", "dense.cpp", "attention.cpp", "step.cpp", "moe.cpp")


def extension_path() -> Path:
    return HERE / (EXT_NAME + sysconfig.get_config_var("EXT_SUFFIX"))


def _torch_flags() -> tuple[list[str], list[str]]:
    import torch
    from torch.utils.cpp_extension import include_paths, library_paths

    inc = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -fopenmp: at::parallel_for is inline code around `#pragma omp parallel`; without the
    # flag it silently runs serially.  The runtime is torch's own libgomp.so.1 (same soname,
    # already loaded by torch, rpath first), so there is one thread pool, not two.
    cflags = inc + [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_API_INCLUDE_EXTENSION_H",
                    f"-DTORCH_EXTENSION_NAME={EXT_NAME}", "-Wno-unused-variable", "-fopenmp"]
    libdirs = library_paths()
    ldflags = [f"-L{d}" for d in libdirs] + [f"-Wl,-rpath,{d}" for d in libdirs]
    ldflags += ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-fopenmp"]
    return cflags, ldflags


def _command(cxx: str, src: Path, obj: Path, flags: list[str]) -> list[str]:
    return [cxx, *COMMON, *flags, "-c", str(src), "-o", str(obj)]


def _stale(cmd: list[str], obj: Path, src: Path, headers: list[Path]) -> bool:
    """Rebuild when the object is missing, older than a source or header, or was built with other flags."""
    stamp = obj.with_suffix(".cmd")
    if not obj.exists() or not stamp.exists() or stamp.read_text() != " ".join(cmd):
        return True
    t = obj.stat().st_mtime
    return any(p.stat().st_mtime > t for p in [src, *headers])


def _compile(cmd: list[str], obj: Path) -> tuple[str, int, str]:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode == 0:
        obj.with_suffix(".cmd").write_text(" ".join(cmd))
    return " ".join(cmd), p.returncode, p.stdout + p.stderr


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if "error" in line.lower():
            return line.strip()[:300]
    return (log.strip().splitlines() or ["unknown error"])[-1][:300]


def build(jobs: int | None = None, verbose: bool = False) -> Path:
    """Compile and link the extension; returns its path or raises RuntimeError with the first error."""
    BUILD.mkdir(exist_ok=True)
    (BUILD / "error.txt").unlink(missing_ok=True)
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"C++ compiler '{cxx}' not found (set CXX or install g++)")
    torch_cflags, ldflags = _torch_flags()
    headers = sorted(CSRC.glob("*.h"))
    todo = []
    for name, flags in SOURCES.items():
        src, obj = CSRC / name, BUILD / (Path(name).stem + ".o")
        cmd = _command(cxx, src, obj, flags + (torch_cflags if name in TORCH_SOURCES else []))
        if _stale(cmd, obj, src, headers):
            todo.append((cmd, obj))
    # the torch-heavy sources first: they are the long poles
    todo.sort(key=lambda t: not any(n in " ".join(t[0]) for n in TORCH_SOURCES))
    log = []
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        for cmd, rc, out in pool.map(lambda t: _compile(*t), todo):
            log.append(f"$ {cmd}\n{out}")
            if verbose:
                print(f"compiled {cmd.split(' -c ')[1].split()[0]}" + (f"\n{out}" if out else ""), flush=True)
            if rc:
                raise RuntimeError(_first_error(out) + "\n" + "\n".join(log))
    target = extension_path()
    objs = [str(BUILD / (Path(n).stem + ".o")) for n in SOURCES]
    if todo or not target.exists():
        tmp = target.with_suffix(".tmp.so")
        cmd = [cxx, "-shared", *objs, "-o", str(tmp), *ldflags]
        p = subprocess.run(cmd, capture_output=True, text=True)
        log.append(f"$ {' '.join(cmd)}\n{p.stdout}{p.stderr}")
        if p.returncode:
            raise RuntimeError(_first_error(p.stdout + p.stderr) + "\n" + "\n".join(log))
        tmp.replace(target)
    (BUILD / "build.log").write_text("\n".join(log))
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-j", "--jobs", type=int, default=None, help="parallel compiles (default: all CPUs)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        path = build(args.jobs, args.verbose)
    except (RuntimeError, OSError, ImportError) as e:
        first, _, rest = str(e).partition("\n")
        BUILD.mkdir(exist_ok=True)
        (BUILD / "build.log").write_text(rest or first)
        (BUILD / "error.txt").write_text(first)
        extension_path().unlink(missing_ok=True)
        print(f"quill native build failed: {first}\n(full log: {BUILD / 'build.log'}); "
              "quill still runs on the torch and reference kernels", file=sys.stderr)
        return 1
    print(f"quill native kernels built: {path.name} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
