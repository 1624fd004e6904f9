"""Compile the bytecode of what the suite's processes import, once, before they start (``make test`` runs it
beside the native build).

uv installs packages without bytecode, so each module is compiled by the first process that imports it; the
test workers collect at the same moment and the first servers start together, each compiling the same
modules (a collection compiles ~16 CPU seconds of torch, transformers, Ray, openai).  Importing them here
writes the bytecode once.  A missing package is only reported: the tests say what they need.
"""

from __future__ import annotations

import importlib
import sys

# what the workers' collection imports (python -X importtime over `pytest --collect-only`), then what a
# `quill serve` and a Ray replica import
MODULES = ("torch", "numpy", "transformers", "transformers.modeling_utils", "safetensors.torch", "gguf",
           "hypothesis", "schemathesis", "openai", "httpx", "jsonschema", "fastapi", "uvicorn", "xgrammar",
           "ray", "ray.serve", "quill.engine.llm", "quill.cli.serve", "quill.serving.app", "quill.serving.ray")


def main() -> int:
    if sys.flags.dont_write_bytecode:
        print("tests/bytecode.py: PYTHONDONTWRITEBYTECODE is set; nothing written", file=sys.stderr)
        return 0
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            print(f"tests/bytecode.py: {name} not imported ({e})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
