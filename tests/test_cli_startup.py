"""`quill --help` and the subcommands' --help answer without importing torch (seconds on a busy machine)."""

import subprocess
import sys

import pytest

from quill.cli import COMMANDS


def imported_torch(args: list[str]) -> tuple[str, bool]:
    """(help text, whether torch was imported) of `python -X importtime -m quill <args>` in a fresh process."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "quill", *args], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    # -X importtime writes one line per module: "import time: self | cumulative | <indent>name"
    modules = {line.rpartition("|")[2].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "quill.cli" in modules, "importtime printed no modules"
    return p.stdout, "torch" in modules


def test_top_level_help_does_not_import_torch():
    out, torch_loaded = imported_torch(["--help"])
    assert out.startswith("usage: quill") and "serve" in out and "bench" in out
    assert not torch_loaded


@pytest.mark.parametrize("command", [m.rpartition(".")[2] for m in COMMANDS])
def test_subcommand_help_does_not_import_torch(command):
    out, torch_loaded = imported_torch([command, "--help"])
    assert out.startswith(f"usage: quill {command}")
    assert not torch_loaded
