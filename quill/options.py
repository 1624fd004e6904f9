"""Run options, parsed and checked once at the boundary (``LLM`` / the CLI) and passed down frozen."""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass

import torch

from quill.errors import ModelError

DTYPES = {"float32": torch.float32}
# Accepted for compatibility (vLLM's CPU backend defaults to it) and run as float32, with a warning:
# measured on AVX-512 BF16 (Zen 5) and AVX2 (Zen 3) CPUs, bfloat16 compute decoded at 0.5-0.9x the
# speed of float32 (the native decode step computes in float32; docs/BENCHMARKS.md, issue 12).
NOT_OFFERED = {"bfloat16": "bfloat16 compute is slower than float32 on CPUs (0.5-0.9x measured)"}


class DtypeNotOfferedWarning(UserWarning):
    """A compute dtype quill accepts but runs as float32."""


class ActQuant(enum.Enum):
    """Activation quantization the user asks for (a checkpoint that prescribes its own always gets it)."""

    NONE = "none"  # float activations (W4A16, W8A16)
    INT8 = "int8"  # int8 per token, dynamic, symmetric (W4A8, W8A8)
    INT8_GROUP = "int8-group"  # int8 per token and weight group, dynamic, symmetric (llama.cpp's int8 blocks)

    @classmethod
    def parse(cls, value: "str | ActQuant | None") -> "ActQuant":
        if isinstance(value, cls):
            return value
        if value is None:
            return cls.NONE
        try:
            return cls(value)
        except ValueError:
            raise ModelError(f"activation_quant '{value}' is not supported; supported: "
                             f"{', '.join(m.value for m in cls)}") from None

    @property
    def request(self) -> str | None:
        """What layers receive: "int8" / "int8-group", or None for float activations."""
        return None if self is ActQuant.NONE else self.value


@dataclass(frozen=True)
class RunOptions:
    """How to run a model: compute dtype, activation quantization, threads, kernel / MoE-backend choice."""

    dtype: torch.dtype = torch.float32
    act_quant: ActQuant = ActQuant.NONE
    threads: int | None = None  # None: the platform's physical cores
    kernel: str | None = None  # force one linear kernel by name
    moe_backend: str | None = None  # force one MoE backend by name
    max_model_len: int | None = None

    @classmethod
    def parse(cls, dtype: str = "float32", activation_quant: "str | ActQuant | None" = None,
              threads: int | None = None, kernel: str | None = None, moe_backend: str | None = None,
              max_model_len: int | None = None) -> "RunOptions":
        """Check every user-facing value once; errors name the parameter, what was found, what is supported."""
        if dtype in NOT_OFFERED:
            warnings.warn(f"dtype '{dtype}' is not offered: {NOT_OFFERED[dtype]}; running float32. "
                          "Pass dtype 'float32' to silence this warning.", DtypeNotOfferedWarning, stacklevel=3)
            dtype = "float32"
        if dtype not in DTYPES:
            raise ModelError(f"dtype '{dtype}' is not supported; supported: {', '.join(DTYPES)} "
                             f"({', '.join(NOT_OFFERED)} is accepted and runs as float32)")
        for name, value in (("threads", threads), ("max_model_len", max_model_len)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ModelError(f"{name}: expected a positive integer, found {value!r}")
        return cls(DTYPES[dtype], ActQuant.parse(activation_quant), threads, kernel, moe_backend, max_model_len)
