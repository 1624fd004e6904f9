"""llama.cpp's own quantizer, run in its own virtualenv (``make llamacpp``: the wheel in ../shared/wheels).

Tests write K-quant GGUF files with it exactly as users get them from llama.cpp.  It is never imported
into quill's interpreter: every call is a subprocess of that virtualenv's python.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
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
    """``llama_model_quantize(src -> dst)`` with ``LLAMA_FTYPE_MOSTLY_<ftype>`` (e.g. Q4_K_M), once per test run
    for the same source bytes (``_shared``)."""
    from quill.bench.llamacpp import quantize_with_llamacpp

    key = _digest([Path(src)], "quantize", ftype)
    return _shared(key, Path(dst), lambda out: quantize_with_llamacpp(llama_python(), Path(src), out, ftype))


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

    checkpoint = Path(checkpoint)
    files = sorted(p for p in checkpoint.iterdir() if p.is_file() and not p.name.endswith((".gguf", ".part")))
    key = _digest(files, "convert", checkpoint.name, outtype, *extra)  # (the directory's name is general.name)
    return _shared(key, Path(out), lambda tmp: convert_hf_to_gguf(checkpoint, tmp, outtype, extra=extra))


# What the tools write, shared by the test run's processes: several modules (on different pytest-xdist workers)
# convert the same tiny checkpoint or quantize the default model the same way; the tools are deterministic, so
# one run per input (its bytes and the tool's arguments) serves them all.  The folder is the run's
# (QUILL_TEST_TOOLS, made and removed by tests/conftest.py); each caller gets its own copy (tests damage files).
def _tool_dir() -> Path:
    d = os.environ.get("QUILL_TEST_TOOLS")
    if not d:  # (imported outside pytest)
        d = os.environ["QUILL_TEST_TOOLS"] = tempfile.mkdtemp(prefix="quill-tools-")
    return Path(d)


def _digest(files: list[Path], *args: str) -> str:
    h = hashlib.sha256("\0".join(args).encode())
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()[:32]


def _shared(key: str, dst: Path, make: Callable[[Path], Path]) -> Path:
    """``dst`` holding what ``make(path)`` writes, made once per key under a lock (the other processes wait)."""
    d = _tool_dir()
    done = d / f"{key}.gguf"
    with open(d / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            part = d / f"{key}.part"
            part.unlink(missing_ok=True)
            make(part)
            part.rename(done)
    if not dst.exists():
        shutil.copyfile(done, dst)
    return dst
