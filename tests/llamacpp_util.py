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


def save_smollm2_tokenizer(directory: Path) -> Path:
    """The default model's tokenizer (SmolLM2, 49152 tokens) as HF files in ``directory``: llama.cpp's converter
    accepts only tokenizers whose pre-tokenizer it knows, and this one it does ("smollm")."""
    from transformers import AutoTokenizer

    from quill.default_model import default_model_path
    gguf = default_model_path()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(directory))
    return directory


def convert(checkpoint: Path, out: Path, outtype: str = "f32", extra: tuple[str, ...] = ()) -> Path:
    """llama.cpp's own ``convert_hf_to_gguf.py`` (the llama-cpp-python 0.3.36 sdist's, fetched once from PyPI)."""
    from quill.bench.llamacpp_src import convert_hf_to_gguf

    return convert_hf_to_gguf(checkpoint, out, outtype, extra=extra)
