"""llama.cpp's own quantizer, run in its own virtualenv (``make llamacpp``: the wheel in ../shared/wheels).

Tests write K-quant GGUF files with it exactly as users get them from llama.cpp.  It is never imported
into quill's interpreter: every call is a subprocess of that virtualenv's python.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def llama_python() -> str:
    """The llama-cpp-python interpreter (``QUILL_LLAMA_PYTHON`` or ``.venv-llamacpp``); fails, never skips."""
    path = Path(os.environ.get("QUILL_LLAMA_PYTHON", REPO / ".venv-llamacpp" / "bin" / "python"))
    if not path.exists():
        pytest.fail(f"llama.cpp's quantizer is needed and {path} does not exist: run `make llamacpp` "
                    "(installs ../shared/wheels/llama_cpp_python-0.3.36-*.whl into .venv-llamacpp)")
    return str(path)


def quantize(src: Path, dst: Path, ftype: str) -> Path:
    """``llama_model_quantize(src -> dst)`` with ``LLAMA_FTYPE_MOSTLY_<ftype>`` (e.g. Q4_K_M), once."""
    from quill.bench.llamacpp import quantize_with_llamacpp

    return quantize_with_llamacpp(llama_python(), src, dst, ftype)
