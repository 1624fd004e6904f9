"""quill's native CPU kernels: the compiled extension, and which ISA variant a CPU runs.

The extension is built by ``make install`` / ``make demo`` (``python -m quill.native.build``),
with the ISA variants this CPU runs (:func:`variant_status`) and the scalar twins.
If it is missing or failed to build, :func:`load` says why in one line, every
native kernel's ``supported()`` returns that line, and quill runs on the
``torch``/``reference`` kernels.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from quill.platform import Platform

_BUILD = Path(__file__).resolve().parent / "_build"

# Variants, best first: (name, flags the CPU needs).  Every kernel family runs exact
# int8 dot products: AVX-512 VNNI (vpdpbusd), else the AVX2 + FMA + F16C baseline
# (vpmaddubsw).  Float activations enter as a fixed-point image (docs/NATIVE.md).
ISAS = (("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")), ("avx2", ("avx2", "fma", "f16c")))


@dataclass(frozen=True)
class NativeExtension:
    """The loaded extension module, or why there is none."""

    module: ModuleType | None
    error: str | None


@lru_cache(maxsize=1)
def load() -> NativeExtension:
    """Import the extension once (cached: the import system's own state, nothing else)."""
    try:
        return NativeExtension(importlib.import_module("quill.native._quill_native"), None)
    except ImportError as e:
        err = _BUILD / "error.txt"
        if err.exists():
            why = f"build failed: {err.read_text().strip()} (log: {_BUILD / 'build.log'})"
        else:
            why = f"{e}; run `make install`"
        return NativeExtension(None, f"extension not built: {why}")


def isa_for(platform: Platform) -> str | None:
    """The variant every native kernel runs on ``platform``: 'avx512', 'avx2', or None (no native kernel)."""
    for name, flags in ISAS:
        if platform.has(*flags):
            return name
    return None


def unsupported(platform: Platform) -> str | None:
    """Why no native kernel runs on ``platform``, or None: the extension is not built, the CPU lacks the weakest
    variant's ISA, or the variant it would run was not compiled (``make demo`` builds only this CPU's best)."""
    ext = load()
    if ext.module is None:
        return ext.error
    isa = isa_for(platform)
    if isa is None:
        return f"needs {isa_requirement()}, which this CPU lacks"
    built = built_variants()
    if isa not in built:
        return (f"the {isa} kernels are not built into this install (built: {', '.join(built)}); "
                "`make native` (python -m quill.native.build) builds every variant this CPU runs")
    return None


def variant_status(platform: Platform) -> dict[str, str | None]:
    """Every ISA variant, best first ('scalar' last) -> None when ``platform`` runs it, else why not. The build
    compiles the variants this CPU runs (quill.native.build), so AVX-512 hosts keep the AVX2 one for --isa avx2."""
    status: dict[str, str | None] = {}
    for name, flags in ISAS:
        missing = platform.missing(*flags)
        status[name] = f"this CPU lacks {', '.join(missing)}" if missing else None
    return status | {"scalar": None}


def built_variants() -> tuple[str, ...]:
    """The ISA variants compiled into the extension, best first; () when it is not built."""
    ext = load().module
    return tuple(ext.isa_backends()) if ext is not None else ()


def isa_requirement() -> str:
    """Human description of the weakest variant's needs, for refusals."""
    return "+".join(f.upper() for f in ISAS[-1][1])
