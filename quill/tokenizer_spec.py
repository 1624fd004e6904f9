"""What a checkpoint provides to build a tokenizer, whatever its container (HF directory or GGUF)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class TokenizerSpec:
    """A ready ``tokenizers.Tokenizer`` plus the special-token facts generation needs.

    Built by a checkpoint (``Checkpoint.tokenizer_spec()`` for HF directories,
    the GGUF checkpoint for GGUF files); wrapped by quill's tokenizer class.
    """

    tokenizer: Any  # tokenizers.Tokenizer
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    add_bos_token: bool = False
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # e.g. {"bos_token": "<s>", ...} for templates

    def facts(self) -> dict:
        """Everything but the tokenizer, as JSON-able data (saved beside ``tokenizer.to_str()``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tokenizer"}

    @classmethod
    def from_saved(cls, tokenizer_json: str, facts: dict) -> "TokenizerSpec":
        """The spec :meth:`facts` and ``tokenizer.to_str()`` describe."""
        from tokenizers import Tokenizer
        return cls(Tokenizer.from_str(tokenizer_json), **{**facts, "eos_token_ids": tuple(facts["eos_token_ids"])})
