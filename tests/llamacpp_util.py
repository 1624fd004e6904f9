"""llama.cpp's own quantizer, run in its own virtualenv (``make llamacpp``: the wheel in ../shared/wheels).

Tests write K-quant GGUF files with it exactly as users get them from llama.cpp.  It is never imported
into quill's interpreter: every call is a subprocess of that virtualenv's python.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_QUANTIZE = r"""
import ctypes, sys, llama_cpp
src, dst, ftype = sys.argv[1:4]
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
p.allow_requantize = True  # the default model is already Q4_1: llama.cpp dequantizes, then quantizes
p.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p)))
"""


def llama_python() -> str:
    """The llama-cpp-python interpreter (``QUILL_LLAMA_PYTHON`` or ``.venv-llamacpp``); fails, never skips."""
    path = Path(os.environ.get("QUILL_LLAMA_PYTHON", REPO / ".venv-llamacpp" / "bin" / "python"))
    if not path.exists():
        pytest.fail(f"llama.cpp's quantizer is needed and {path} does not exist: run `make llamacpp` "
                    "(installs ../shared/wheels/llama_cpp_python-0.3.36-*.whl into .venv-llamacpp)")
    return str(path)


def quantize(src: Path, dst: Path, ftype: str) -> Path:
    """``llama_model_quantize(src -> dst)`` with ``LLAMA_FTYPE_MOSTLY_<ftype>`` (e.g. Q4_K_M)."""
    if not dst.exists():
        tmp = dst.with_suffix(".part")
        p = subprocess.run([llama_python(), "-c", _QUANTIZE, str(src), str(tmp), ftype],
                           capture_output=True, text=True, check=False)
        if p.returncode:
            raise RuntimeError(f"llama.cpp could not quantize {src.name} to {ftype}: {p.stderr[-2000:]}")
        tmp.rename(dst)
    return dst
