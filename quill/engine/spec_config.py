"""``--speculative-config`` / ``LLM(speculative_config=...)``: what speculative decoding runs (vLLM's JSON names).

    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "smaller.gguf", "num_speculative_tokens": 4}

Checked before anything loads (``quill.options.RunOptions`` parses it), so a bad value is a ``ConfigError``
naming the field, what was found and what is supported.  Imports no torch: the CLI parses it at start-up.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quill.engine.hub import looks_like_hub_id
from quill.errors import ConfigError

METHODS = ("ngram", "draft_model")
# vLLM's aliases for n-gram lookup ("[ngram]" as the model name was its older spelling)
ALIASES = {"[ngram]": "ngram"}
KNOWN_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "adaptive")
FIELD = "speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    """Checked speculative-decoding settings (``parse`` builds one from vLLM's JSON)."""

    method: str = "ngram"
    model: str | None = None  # draft_model: the draft's path or Hub id (same tokenizer as the target)
    num_speculative_tokens: int = 3  # k: tokens proposed (and verified) per step at most
    prompt_lookup_min: int = 1  # shortest suffix n-gram looked up in the sequence's earlier tokens
    prompt_lookup_max: int = 3  # longest (tried first)
    # quill's own: draft only where it pays, from measured step times and each sequence's acceptance
    # (quill.engine.spec_cost); false: every step drafts up to num_speculative_tokens wherever it can
    adaptive: bool = True

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"{FIELD}.method: unknown method {self.method!r}; supported: {', '.join(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{FIELD}.{name}: expected an integer >= 1, found {v!r}")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"{FIELD}.adaptive: expected true or false, found {self.adaptive!r}")
        if self.method == "draft_model":
            _check_draft_path(self.model)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"{FIELD}.prompt_lookup_min: {self.prompt_lookup_min} is above prompt_lookup_max "
                              f"{self.prompt_lookup_max}; supported: min <= max")

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeConfig | None":
        """From a dict, a JSON object's text, a ``SpeculativeConfig`` or None (off)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{FIELD}: not valid JSON ({e}): {value}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{FIELD}: expected a JSON object such as "
                              f"{{\"method\": \"ngram\", \"num_speculative_tokens\": 3}}, found {value!r}")
        unknown = sorted(set(value) - set(KNOWN_KEYS))
        if unknown:
            raise ConfigError(f"{FIELD}: unknown key(s) {', '.join(unknown)}; supported: {', '.join(KNOWN_KEYS)}")
        return cls(**_normalised(dict(value)))

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["model"] is None:  # n-gram lookup takes none (vLLM's dict has no such key then)
            del out["model"]
        if out["adaptive"]:  # the default; quill's own key, so vLLM's dict stays vLLM's
            del out["adaptive"]
        return out

    def describe(self) -> str:
        """For the load line and ``quill inspect``."""
        when = ("drafted where measured step times and each sequence's acceptance say it pays" if self.adaptive
                else "drafted every step (adaptive: false)")
        if self.method == "draft_model":
            return (f"draft_model {self.model}, up to {self.num_speculative_tokens} tokens per step (greedy drafts "
                    f"from the draft's own paged KV), verified in one forward; {when}")
        return (f"{self.method}, up to {self.num_speculative_tokens} draft tokens per step from the sequence's own "
                f"earlier tokens (suffix {self.prompt_lookup_min}-{self.prompt_lookup_max} tokens), verified in "
                f"one forward; {when}")


def _check_draft_path(model: Any) -> None:
    """The draft's path exists (or is a Hub id); its tokenizer is compared with the target's once the
    target's path is known (``quill.engine.draft.check_same_tokenizer``)."""
    if model is None:
        raise ConfigError(f"{FIELD}.model: missing; draft_model needs the draft's path or Hub id")
    if not isinstance(model, (str, Path)):
        raise ConfigError(f"{FIELD}.model: expected a path or Hub id, found {model!r}")
    if not Path(model).expanduser().exists() and not looks_like_hub_id(str(model)):
        raise ConfigError(f"{FIELD}.model: {model}: no such file or directory (nor a Hub id like 'org/name'); "
                          "supported: a checkpoint quill loads that shares the target's tokenizer")


def _normalised(value: dict) -> dict:
    """vLLM's spellings: the method from "model" when only that names it (a path: a draft model), min / max
    from each other."""
    model = value.pop("model", None)
    implied = None if model is None else ALIASES.get(model, model if model in METHODS else "draft_model")
    method = value.get("method", implied)
    if method is None:
        raise ConfigError(f"{FIELD}.method: missing; supported: {', '.join(METHODS)}")
    if not isinstance(method, str):
        raise ConfigError(f"{FIELD}.method: expected a string, found {method!r}; supported: {', '.join(METHODS)}")
    value["method"] = ALIASES.get(method, method)
    if model is not None and value["method"] == "ngram" and ALIASES.get(model, model) != "ngram":
        raise ConfigError(f"{FIELD}.model: n-gram lookup takes no model, found {model!r}")
    if value["method"] == "draft_model":
        value["model"] = None if model is None else str(model)
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    if lo is None and hi is not None:  # vLLM: one given, the other equals it (neither: quill's 1-3)
        value["prompt_lookup_min"] = hi
    if hi is None and lo is not None:
        value["prompt_lookup_max"] = lo
    return value
