"""What a benchmark JSON records about the run that wrote it: CPU, date, quill commit, torch and llama.cpp.

docs/BENCHMARKS.md (``python -m quill.bench.page``) reads these fields; a JSON written before they
existed shows "—" there, so every comparison tool puts this block under ``"meta"``.
"""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def git_commit(repo: Path = REPO) -> str | None:
    """The checkout's commit (``+dirty`` when tracked files differ from it), or None outside a git checkout."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)

    try:
        head = git("rev-parse", "--short=12", "HEAD")
    except OSError:  # no git binary
        return None
    if head.returncode:
        return None
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")


def llamacpp_version(python: str | None, lib: Path | None = None) -> str | None:
    """llama-cpp-python's version in the interpreter ``python`` (its own virtualenv), and the library used."""
    if python is None:
        return None
    p = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                       capture_output=True, text=True, check=False)
    if p.returncode:
        return None
    version = f"llama-cpp-python {p.stdout.strip()}"
    return f"{version}, library {lib}" if lib else f"{version} (its wheel's library)"


def llama_server_version(binary: str | None) -> str | None:
    """``llama-server --version``'s first line (it prints e.g. "version: 6123 (abc1234)" to stderr)."""
    if binary is None:
        return None
    try:
        p = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False, timeout=60)
    except OSError:
        return None
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.startswith("version")]
    return f"llama-server {lines[0].split(':', 1)[1].strip()}" if lines else None


def run_metadata(platform, threads: int, *, llama_python: str | None = None, llama_lib: Path | None = None,
                 llama_server: str | None = None, command: str | None = None) -> dict:
    """The ``"meta"`` block: ``platform`` is the :class:`quill.platform.Platform` the run used."""
    import torch

    import quill

    return {
        "cpu": platform.summary(),
        "cpu_model": platform.model_name or None,
        "cpu_family": None if platform.family is None else
        f"{platform.vendor} family {platform.family} model {platform.model} ({platform.microarch})",
        "cores": platform.physical_cores,
        "threads": threads,
        "isa": platform.isa_level,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "quill": quill.__version__,
        "torch": torch.__version__,
        "llama_cpp": llamacpp_version(llama_python, llama_lib) or llama_server_version(llama_server),
        "command": command,
    }
