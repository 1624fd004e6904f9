"""The import rules of docs/DESIGN.md ("The house"), read from the source: the engine and the model files
reach kernels only through quill.layers, the engine names no model architecture, native code imports
nothing above it, and the test-only padded cache stays out of the package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import quill
from quill.models import ARCHITECTURES

ROOT = Path(quill.__file__).parent
BELOW_LAYERS = ("quill.kernels", "quill.native", "quill.moe")
# the engine resolves a model through quill.models and asks it for its step: no architecture by name
ARCHITECTURE_MODULES = tuple(sorted({f"quill.models.{m}" for m in ARCHITECTURES.values()}))


def imported(path: Path, root: Path = ROOT) -> set[str]:
    """Every module ``path`` imports, absolute (``from quill import native`` -> ``quill.native``), anywhere
    in the file (function-local imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom):  # relative: resolve against the file's package
            package = ".".join(path.relative_to(root.parent).with_suffix("").parts[:-node.level])
            base = f"{package}.{node.module}" if node.module else package
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("path", modules("engine") + modules("models"), ids=lambda p: str(p.relative_to(ROOT)))
def test_engine_and_models_import_no_kernel_native_or_moe_module(path):
    bad = sorted(n for n in imported(path) if under(n, BELOW_LAYERS))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: reach them through quill.layers"


@pytest.mark.parametrize("path", modules("engine"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_engine_imports_no_model_architecture(path):
    bad = sorted(n for n in imported(path) if under(n, ARCHITECTURE_MODULES))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: ask the model (quill.models.base.DecoderLM)"


@pytest.mark.parametrize("path", modules("native"), ids=lambda p: str(p.relative_to(ROOT)))
def test_native_imports_nothing_above_it(path):
    bad = sorted(n for n in imported(path) if under(n, ("quill.kernels", "quill.layers", "quill.moe",
                                                         "quill.models", "quill.engine")))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: move what it shares down (quill.canonical)"


def test_the_package_does_not_import_the_tests_padded_cache():
    users = [p for p in ROOT.rglob("*.py") if any(under(n, ("tests", "quill.engine.cache")) for n in imported(p))]
    assert not users


def test_the_walker_sees_every_spelling(tmp_path):
    """Absolute, from-, function-local and relative imports are all seen (so the rules above can fail)."""
    probe = tmp_path / "quill" / "engine" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from quill import native\nimport quill.kernels.fused\n"
                     "def f():\n    from quill.moe import route\n    from ..models import llama\n")
    found = imported(probe, tmp_path / "quill")
    assert {"quill.native", "quill.kernels.fused", "quill.moe.route", "quill.models.llama"} <= found
    assert under("quill.models.llama", ARCHITECTURE_MODULES) and not under("quill.models.base", ARCHITECTURE_MODULES)
