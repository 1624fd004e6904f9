"""``--speculative-config`` / ``LLM(speculative_config=...)``: what speculative decoding runs (vLLM's JSON names).

    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

Checked before anything loads (``quill.options.RunOptions`` parses it), so a bad value is a ``ConfigError``
naming the field, what was found and what is supported.  Imports no torch: the CLI parses it at start-up.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from quill.errors import ConfigError

METHODS = ("ngram",)  # what runs; "draft_model" is vLLM's name for the proposer not implemented yet
NOT_YET = {"draft_model": "the draft-model proposer is not implemented yet (issue 39); use \"ngram\""}
# vLLM's aliases for n-gram lookup ("[ngram]" as the model name was its older spelling)
ALIASES = {"[ngram]": "ngram"}
KNOWN_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
FIELD = "speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    """Checked speculative-decoding settings (``parse`` builds one from vLLM's JSON)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3  # k: tokens proposed (and verified) per step at most
    prompt_lookup_min: int = 1  # shortest suffix n-gram looked up in the sequence's earlier tokens
    prompt_lookup_max: int = 3  # longest (tried first)

    def __post_init__(self):
        if self.method in NOT_YET:
            raise ConfigError(f"{FIELD}.method: '{self.method}': {NOT_YET[self.method]}")
        if self.method not in METHODS:
            raise ConfigError(f"{FIELD}.method: unknown method {self.method!r}; supported: {', '.join(METHODS)} "
                              f"(not yet: {', '.join(NOT_YET)})")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{FIELD}.{name}: expected an integer >= 1, found {v!r}")
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
        return asdict(self)

    def describe(self) -> str:
        """For the load line and ``quill inspect``."""
        return (f"{self.method}, up to {self.num_speculative_tokens} draft tokens per step from the sequence's own "
                f"earlier tokens (suffix {self.prompt_lookup_min}-{self.prompt_lookup_max} tokens), verified in "
                "one forward; adaptive per sequence")


def _normalised(value: dict) -> dict:
    """vLLM's spellings: the method from "model" when only that names it, min / max from each other."""
    model = value.pop("model", None)
    method = value.get("method", ALIASES.get(model, model))
    if method is None:
        raise ConfigError(f"{FIELD}.method: missing; supported: {', '.join(METHODS)}")
    if not isinstance(method, str):
        raise ConfigError(f"{FIELD}.method: expected a string, found {method!r}; supported: {', '.join(METHODS)}")
    value["method"] = ALIASES.get(method, method)
    if model is not None and value["method"] == "ngram" and ALIASES.get(model, model) != "ngram":
        raise ConfigError(f"{FIELD}.model: n-gram lookup takes no model, found {model!r}")
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    if lo is None and hi is not None:  # vLLM: one given, the other equals it (neither: quill's 1-3)
        value["prompt_lookup_min"] = hi
    if hi is None and lo is not None:
        value["prompt_lookup_max"] = lo
    return value
