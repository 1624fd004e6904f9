"""`quill --help` and the subcommands' --help answer without importing torch (seconds on a busy machine)."""

import subprocess
import sys

import pytest

from quill.cli import COMMANDS


def imported_torch(args: list[str], code: int = 0) -> tuple[str, bool]:
    """(output, whether torch was imported) of `python -X importtime -m quill <args>` in a fresh process, which
    exits with ``code`` (output: stdout, or on an error the lines of stderr that are not import times)."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "quill", *args], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == code, p.stderr[-2000:]
    # -X importtime writes one line per module: "import time: self | cumulative | <indent>name"
    lines = p.stderr.splitlines()
    modules = {line.rpartition("|")[2].strip() for line in lines if line.startswith("import time:")}
    assert "quill.cli" in modules, "importtime printed no modules"
    said = p.stdout if code == 0 else "\n".join(line for line in lines if not line.startswith("import time:"))
    return said, "torch" in modules


def test_top_level_help_does_not_import_torch():
    out, torch_loaded = imported_torch(["--help"])
    assert out.startswith("usage: quill") and "serve" in out and "bench" in out
    assert not torch_loaded


@pytest.mark.parametrize("command", [m.rpartition(".")[2] for m in COMMANDS])
def test_subcommand_help_does_not_import_torch(command):
    out, torch_loaded = imported_torch([command, "--help"])
    assert out.startswith(f"usage: quill {command}")
    assert not torch_loaded


@pytest.mark.parametrize("flags, message", [
    (["--max-body-size", "lots"], "--max-body-size: expected bytes such as 2GiB"),
    (["--stream-interval", "0"], "--stream-interval: expected an integer >= 1, found 0"),
    (["--replicas", "2", "--header-timeout", "5"], "--header-timeout: not available with replicas"),
    (["--replicas", "2", "--min-replicas", "1"], "--replicas fixes the count"),
    (["--min-replicas", "1", "--max-replicas", "2", "--autoscaling-config", "[1]"],
     "--autoscaling-config: expected a JSON object"),
])
def test_serve_refuses_bad_flags_before_importing_torch(flags, message):
    """A mistyped flag is refused at once (it took 3-4 s of importing torch on a 2-core machine)."""
    said, torch_loaded = imported_torch(["serve", "--port", "0", *flags], code=2)
    assert f"quill: error: {message}" in said, said
    assert not torch_loaded
