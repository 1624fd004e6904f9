"""Run options: one spec for ``LLM``'s keywords, the command-line flags and every process they travel to.

``RunOptions``' fields are ``quill.LLM``'s keyword arguments of the same names and defaults; each
field's metadata (``Flag``) generates its command-line flag (``quill.cli.common.add_model_args``).
The CLI, ``quill serve`` (one engine or Ray replicas), ``quill.serving.ray.build_app`` and the
lm-eval adapter all build one ``RunOptions`` and hand it, or its ``asdict``, to ``LLM`` unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quill.engine.spec_config import SpeculativeConfig
from quill.errors import ConfigError, ModelError
from quill.platform import ISA_CHOICES

DTYPES = ("float32",)  # torch is imported only where a model loads (not by the CLI's start-up)
# Accepted for compatibility (vLLM's CPU backend defaults to it) and run as float32, with a warning:
# measured on AVX-512 BF16 (Zen 5) and AVX2 (Zen 3) CPUs, bfloat16 compute decoded at 0.5-0.9x the
# speed of float32 (the native decode step computes in float32; docs/lab/BENCHMARKS-notebook.md, issue 12).
NOT_OFFERED = {"bfloat16": "bfloat16 compute is slower than float32 on CPUs (0.5-0.9x measured)"}
# quill.engine.core.KV_CACHE_DTYPES (tests/test_options.py checks they agree; core is not imported here)
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


class OptionError(ConfigError, ModelError):
    """A run option with a value quill does not take (a ConfigError; also a ModelError, as these were once)."""


class DtypeNotOfferedWarning(UserWarning):
    """A compute dtype quill accepts but runs as float32."""


class ActQuant(enum.Enum):
    """Activation quantization the user asks for (a checkpoint that prescribes its own always gets it)."""

    AUTO = "auto"  # the format's own: int8-group for GGUF (llama.cpp's arithmetic), float for the others
    NONE = "none"  # float activations (W4A16, W8A16), GGUF files too; native kernels: a 16-bit image
    EXACT = "exact"  # float activations exact to float32 rounding (native kernels: the 24-bit image)
    INT8 = "int8"  # int8 per token, dynamic, symmetric (W4A8, W8A8)
    INT8_GROUP = "int8-group"  # int8 per token and weight group, dynamic, symmetric (llama.cpp's int8 blocks)

    @classmethod
    def parse(cls, value: "str | ActQuant | None") -> "ActQuant":
        if isinstance(value, cls):
            return value
        if value is None:  # the keyword's default once meant float; now the two are spelled out
            raise OptionError("activation_quant: None is not an option; 'auto' (the default: the format's own) "
                             "or 'none' (float activations)")
        try:
            return cls(value)
        except ValueError:
            raise OptionError(f"activation_quant '{value}' is not supported; supported: "
                             f"{', '.join(m.value for m in cls)}") from None

    def resolve(self, gguf: bool) -> "ActQuant":
        """AUTO made concrete for a checkpoint: GGUF files run llama.cpp's arithmetic (int8 per token and
        32-value block, ``int8-group``); AWQ / GPTQ / compressed-tensors / AutoRound keep their tools'
        float forward (W8A8 checkpoints prescribe their own, which layers honour whatever this says)."""
        if self is not ActQuant.AUTO:
            return self
        return ActQuant.INT8_GROUP if gguf else ActQuant.NONE

    @property
    def request(self) -> str | None:
        """What layers receive: "int8" / "int8-group" / "exact", or None for float activations (AUTO: resolve
        first)."""
        if self is ActQuant.AUTO:
            raise ValueError("ActQuant.AUTO has no layer request; resolve() it for the checkpoint first")
        return None if self is ActQuant.NONE else self.value

    @property
    def is_float(self) -> bool:
        return self in (ActQuant.NONE, ActQuant.EXACT)


@dataclass(frozen=True)
class Flag:
    """How a ``RunOptions`` field appears on the command line."""

    name: str  # e.g. "--act-quant"
    help: str
    choices: tuple[str, ...] = ()
    kind: str = "str"  # "str", "int", "bool" or "json"; how a string value (build_app, lm-eval model_args) converts
    negated: bool = False  # a bool field whose flag turns it off ("--no-cache" sets cache=False)


def _opt(default, flag: str, help: str, **kw):
    return field(default=default, metadata={"flag": Flag(flag, help, **kw)})


@dataclass(frozen=True)
class RunOptions:
    """How to run a model: ``quill.LLM``'s keyword arguments (same names, same defaults), checked once."""

    dtype: str = _opt("float32", "--dtype", "compute dtype (bfloat16 is accepted and runs as float32, with a "
                      "warning: slower than float32 on CPUs)", choices=tuple(DTYPES) + tuple(NOT_OFFERED))
    activation_quant: str = _opt(
        "auto", "--act-quant",
        "activations of quantized layers: auto (default) = int8 per token and weight group for GGUF files "
        "(llama.cpp's own arithmetic), float for AWQ / GPTQ / compressed-tensors / AutoRound (their tools' "
        "forward); none: float, GGUF too (native kernels multiply a 16-bit fixed-point image of each 128 "
        "inputs: mean KL 5e-8 against exact); exact: float, exact to float32 rounding (a 24-bit image, one "
        "more int8 product per weight); int8: int8 per token (W4A8 / W8A8); int8-group: per token and "
        "weight group; a W8A8 checkpoint always runs with its own", choices=tuple(m.value for m in ActQuant))
    kv_cache_dtype: str | None = _opt(
        None, "--kv-cache-dtype", "element type of the KV cache (default auto = float16, llama.cpp's default: "
        "half the memory and what decode attention reads); float32 for the exact cache",
        choices=KV_CACHE_DTYPES)
    threads: int | None = _opt(None, "--threads", "CPU threads (default: the physical cores this process may use)",
                               kind="int")
    kernel: str | None = _opt(None, "--kernel", "force one linear kernel by name (see `quill info`)")
    moe_backend: str | None = _opt(None, "--moe-backend", "force one MoE backend by name (grouped, reference)")
    isa: str = _opt("native", "--isa", "avx2: run the kernel variants of an AVX2-only CPU (Zen 2/3) on this "
                    "one, the same bits (pair it with ATEN_CPU_CAPABILITY=avx2 so torch's own ops do the same)",
                    choices=tuple(ISA_CHOICES))
    max_model_len: int | None = _opt(None, "--max-model-len", "cap the context window", kind="int")
    offline: bool = _opt(False, "--offline", "resolve Hub ids from the local cache only", kind="bool")
    cache: bool | None = _opt(None, "--no-cache", "neither read nor write the prepacked cache (kernel layouts "
                              "saved after a first load)", kind="bool", negated=True)
    cache_dir: str | None = _opt(None, "--cache-dir", "the prepacked cache's directory (default: "
                                 "$QUILL_CACHE_DIR, else ~/.cache/quill)")
    speculative_config: dict | None = _opt(
        None, "--speculative-config", "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 3, \"prompt_lookup_min\": 1, \"prompt_lookup_max\": 3}' (n-gram prompt "
        "lookup) or '{\"method\": \"draft_model\", \"model\": \"draft.gguf\", \"num_speculative_tokens\": 4}' "
        "(a draft model with the target's tokenizer)", kind="json")

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if self.dtype in NOT_OFFERED:
            warnings.warn(f"dtype '{self.dtype}' is not offered: {NOT_OFFERED[self.dtype]}; running float32. "
                          "Pass dtype 'float32' to silence this warning.", DtypeNotOfferedWarning, stacklevel=4)
            set_("dtype", "float32")
        if self.dtype not in DTYPES:
            raise OptionError(f"dtype '{self.dtype}' is not supported; supported: {', '.join(DTYPES)} "
                             f"({', '.join(NOT_OFFERED)} is accepted and runs as float32)")
        ActQuant.parse(self.activation_quant)
        spec = SpeculativeConfig.parse(self.speculative_config)  # JSON text or a dict; checked before loading
        set_("speculative_config", None if spec is None else spec.as_dict())
        for f in dataclasses.fields(self):
            _check(f.name, getattr(self, f.name), f.metadata["flag"], f.default)

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)

    @property
    def act_quant(self) -> ActQuant:
        """What the user asked for (AUTO until ``ActQuant.resolve`` knows the checkpoint)."""
        return ActQuant.parse(self.activation_quant)

    @classmethod
    def from_mapping(cls, values: dict[str, Any], where: str) -> "RunOptions":
        """From keys and values that may be strings (``serve run ... build_app threads=2``, lm-eval's
        ``model_args``); an unknown key is an error naming ``where`` and the known keys."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise OptionError(f"{where}: unknown option(s) {', '.join(unknown)}; known: {', '.join(known)}")
        return cls(**{k: _from_string(k, v, known[k].metadata["flag"]) for k, v in values.items()})

    def llm_kwargs(self) -> dict[str, Any]:
        """``quill.LLM``'s keyword arguments: every field, by name."""
        return dataclasses.asdict(self)


def _check(name: str, value, flag: Flag, default) -> None:
    if value is None and default is None:
        return
    if flag.kind == "json":  # parsed and checked by its own class (SpeculativeConfig)
        return
    if flag.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OptionError(f"{name}: expected a positive integer, found {value!r}")
    elif flag.kind == "bool":
        if not isinstance(value, bool):
            raise OptionError(f"{name}: expected true or false, found {value!r}")
    elif not isinstance(value, str) and not (name == "cache_dir" and isinstance(value, os.PathLike)):
        raise OptionError(f"{name}: expected a string, found {value!r}")
    elif flag.choices and name != "dtype" and value not in flag.choices:  # dtype: checked with its own message
        raise OptionError(f"{name} '{value}' is not supported; supported: {', '.join(flag.choices)}")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _from_string(name: str, value, flag: Flag):
    """A string value converted to the field's kind; other values pass through (checked by the class)."""
    if not isinstance(value, str) or flag.kind in ("str", "json"):
        return value
    text = value.strip().lower()
    if text in ("", "none", "auto"):
        return None
    if flag.kind == "bool" and text in _TRUE + _FALSE:
        return text in _TRUE
    if flag.kind == "int" and text.isdigit():
        return int(text)
    raise OptionError(f"{name}: expected {'true or false' if flag.kind == 'bool' else 'an integer'}, found {value!r}")


def is_gguf(path: Path) -> bool:
    """Whether ``path`` loads as a GGUF file (the test ``quill.formats.checkpoint.open_checkpoint`` makes)."""
    return path.is_file() and path.suffix == ".gguf"


_ACT_WORDS = {ActQuant.NONE: "float, a 16-bit image in native kernels", ActQuant.EXACT: "float, exact",
              ActQuant.INT8: "int8 per token",
              ActQuant.INT8_GROUP: "int8 per token and weight group"}  # GGUF: llama.cpp's 32 (16 in some K-quants)


def describe_activations(requested: ActQuant, resolved: ActQuant, gguf: bool, prescribed: bool) -> str:
    """Which activation arithmetic runs and why, for the load line and ``quill inspect``."""
    what = _ACT_WORDS[resolved]
    if requested is not ActQuant.AUTO:
        why = f"--act-quant {requested.value}"
    elif gguf:
        why = "GGUF default, llama.cpp's arithmetic; --act-quant none for float"
    else:
        why = "default for this format: its quantization tool's forward; --act-quant int8-group to quantize"
    if prescribed and resolved.is_float:
        return f"int8 where the checkpoint prescribes it (W8A8, its own arithmetic), float elsewhere ({why})"
    return f"{what} ({why})" + ("; W8A8 layers keep the checkpoint's own" if prescribed else "")


def describe_kv_cache(requested: str | None, actual: str) -> str:
    """The KV cache's element type and why."""
    if requested in (None, "auto"):
        return f"{actual} (default, as llama.cpp's; --kv-cache-dtype float32 for float32)"
    return f"{actual} (--kv-cache-dtype {requested})"
