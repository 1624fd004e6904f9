"""Locate and load the real-tool conformance fixtures (../shared/fixtures beside the checkout)."""

from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent


def fixtures_dir() -> Path:
    """$QUILL_FIXTURES_DIR, else ../shared/fixtures, else ./shared/fixtures; fails loudly if absent."""
    candidates = [os.environ.get("QUILL_FIXTURES_DIR"), ROOT.parent / "shared" / "fixtures",
                  ROOT / "shared" / "fixtures"]
    for c in candidates:
        if c and Path(c).is_dir():
            return Path(c)
    raise FileNotFoundError(
        "conformance fixtures not found: expected ../shared/fixtures beside the checkout "
        "(or set QUILL_FIXTURES_DIR)")


def fixture_names(prefix: str = "") -> list[str]:
    d = fixtures_dir()
    return sorted(p.name for p in d.iterdir() if p.is_dir() and p.name.startswith(prefix))


def fixture_path(name: str) -> Path:
    return fixtures_dir() / name


def expected_weights(name: str) -> dict:
    """The tool's own dequantized float32 weights, keyed by module name."""
    return load_file(str(fixture_path(name) / "expected.safetensors"))


def reference(name: str) -> dict:
    """input_ids [2, 16], logits [2, 16, vocab] (and logits_act_qdq for W8A8)."""
    return load_file(str(fixture_path(name) / "reference.safetensors"))
