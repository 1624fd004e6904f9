"""compressed-tensors ``quantization_config``: parsing, and which scheme applies to which module.

Everything here follows compressed-tensors 0.19 (``quantization/quant_args.py``,
``quant_scheme.py``, ``quant_config.py``, ``lifecycle/apply.py``, ``utils/match.py``)
and the older writers it still has to read:

* A ``QuantizationArgs`` with no ``strategy`` infers it from ``group_size``:
  None -> tensor, > 0 -> group, -1 -> channel.
* ``actorder``: "group" (alias "dynamic", legacy ``true``) stores ``weight_g_idx``
  (compressed-tensors <= 0.18 writes it; 0.19 refuses such configs, we still read
  them); "weight" (alias "static") only changed calibration, nothing is stored.
* A config group is a scheme dict or, for a preset name such as ``W4A16``, a
  list of targets.
* Targets and ignore entries are exact module names, ``re:<pattern>`` (Python
  ``re.match``, i.e. anchored at the start only) or class names.  A module is
  quantized when some target matches it and no ignore entry does.  When several
  targets match, the first of (exact names, then regexes, then class names, each
  sorted as strings) decides; a target repeated in several groups belongs to the
  last of them.
* The storage format of a module is its group's ``format``, else the top-level
  ``format`` (unless "mixed-precision"), else what compressed-tensors infers from
  the scheme (int-quantized when the inputs are quantized too, else pack-quantized).

A checkpoint only has tensor names, not module classes, so the class name
``Linear`` is resolved from the tensors: a module is a Linear when it stores
quantized tensors, or when it stores a dense ``weight`` and another module of the
same role (same name with layer / expert numbers ignored) is quantized.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from quill.errors import ConfigError, UnsupportedFormatError, format_choices
from quill.formats.base import config_field

PACKED = "pack-quantized"
UNPACKED = ("int-quantized", "naive-quantized")
SUPPORTED_FORMATS = (PACKED, *UNPACKED)
SUPPORTED_WEIGHT_BITS = (2, 3, 4, 8)
CLASS_TARGETS = ("Linear",)  # class names a target may use; see the module docstring

# Formats compressed-tensors knows that quill does not read, with why.
UNSUPPORTED_FORMATS = {
    "float-quantized": "FP8 weights",
    "nvfp4-pack-quantized": "NVFP4 weights",
    "mxfp4-pack-quantized": "MXFP4 weights",
    "mxfp8-quantized": "MXFP8 weights",
    "marlin-24": "2:4-sparse Marlin weights",
    "sparse-bitmask": "bitmask-sparse weights",
    "sparse-24-bitmask": "2:4-sparse weights",
    "dense": "fake-quantized float weights (saved without compression)",
    "fakequant": "fake-quantized float weights (saved without compression)",
}
_ACTORDER = {"group": "group", "dynamic": "group", "weight": "weight", "static": "weight"}


@dataclass(frozen=True)
class WeightArgs:
    """How a group's weights are quantized (int only)."""

    bits: int
    strategy: str  # "tensor" | "channel" | "group"
    group_size: int | None  # the configured size for "group", else None
    symmetric: bool
    act_order: str | None  # "group" (weight_g_idx stored) | "weight" (nothing stored) | None

    @property
    def stores_g_idx(self) -> bool:
        # compressed-tensors only creates weight_g_idx for the group strategy
        return self.act_order == "group" and self.strategy == "group"


@dataclass(frozen=True)
class InputArgs:
    """How a group's layer inputs are quantized at run time (int8)."""

    dynamic: bool  # True: per token at run time; False: static per tensor (input_scale stored)
    symmetric: bool


@dataclass(frozen=True)
class Scheme:
    """One config group, resolved."""

    group: str
    targets: tuple[str, ...]
    weights: WeightArgs
    inputs: InputArgs | None
    format: str

    def summary(self) -> str:
        """e.g. 'pack-quantized W4A16 g128 sym'."""
        w = self.weights
        g = {"group": f"g{w.group_size}", "channel": "channel", "tensor": "tensor"}[w.strategy]
        a = "A16" if self.inputs is None else ("A8 dynamic" if self.inputs.dynamic else "A8 static")
        ao = f" actorder={w.act_order}" if w.act_order else ""
        return f"{self.format} W{w.bits}{a} {g} {'sym' if w.symmetric else 'asym'}{ao}"

    def label(self) -> str:
        """e.g. "config group 'group_0' (pack-quantized W4A16 g128 sym)"."""
        return f"config group '{self.group}' ({self.summary()})"


# ---- QuantizationArgs ------------------------------------------------------

def _strategy(args: Mapping[str, Any], where: str) -> str:
    strategy = config_field(args, "strategy", str, None, where)
    group_size = config_field(args, "group_size", int, None, where)
    if strategy is not None:
        return strategy.lower()
    if group_size is None:
        return "tensor"
    if group_size > 0:
        return "group"
    if group_size == -1:
        return "channel"
    raise ConfigError(f"{where}.group_size: {group_size} is invalid; supported: a positive size, -1 (channel) or null")


def _int_type(args: Mapping[str, Any], where: str, what: str) -> int:
    kind = config_field(args, "type", str, "int", where).lower()
    if kind != "int":
        raise UnsupportedFormatError(f"{where}.type: {kind} {what} are not supported; supported: int")
    return config_field(args, "num_bits", int, 8, where)


def parse_weight_args(args: Any, where: str) -> WeightArgs:
    """Validate a group's ``weights`` QuantizationArgs."""
    if not isinstance(args, Mapping):
        raise ConfigError(f"{where}: expected an object, found {args!r}")
    bits = _int_type(args, where, "weights")
    if bits not in SUPPORTED_WEIGHT_BITS:
        raise UnsupportedFormatError(
            f"{where}.num_bits: {bits}-bit weights are not supported; supported: "
            f"{', '.join(map(str, SUPPORTED_WEIGHT_BITS))}")
    strategy = _strategy(args, where)
    if strategy not in ("tensor", "channel", "group"):
        raise UnsupportedFormatError(
            f"{where}.strategy: '{strategy}' weight quantization is not supported; supported: channel, group, tensor")
    group_size = config_field(args, "group_size", int, None, where)
    if strategy == "group":
        if group_size is None or group_size <= 0:
            raise ConfigError(f"{where}.group_size: strategy 'group' needs a positive group_size, found {group_size}")
    elif group_size is not None and group_size > 0:
        raise ConfigError(f"{where}.group_size: {group_size} needs strategy 'group', found '{strategy}'")
    if config_field(args, "dynamic", (bool, str), False, where) is not False:
        raise UnsupportedFormatError(f"{where}.dynamic: dynamic weight quantization is not supported; supported: false")
    _check_scale_dtype(args, where)
    return WeightArgs(bits, strategy, group_size if strategy == "group" else None,
                      config_field(args, "symmetric", bool, True, where), _act_order(args, where))


def _act_order(args: Mapping[str, Any], where: str) -> str | None:
    value = args.get("actorder")
    if value is None or value is False:
        return None
    if value is True:  # legacy spelling of "group"
        return "group"
    if isinstance(value, str) and value.lower() in _ACTORDER:
        return _ACTORDER[value.lower()]
    raise ConfigError(f"{where}.actorder: {value!r} is invalid; supported: group, weight, null")


def _check_scale_dtype(args: Mapping[str, Any], where: str) -> None:
    value = args.get("scale_dtype")
    if value is None:
        return
    name = str(value).removeprefix("torch.")
    if name not in ("float16", "bfloat16", "float32"):
        raise UnsupportedFormatError(
            f"{where}.scale_dtype: {value} scales are not supported; supported: float16, bfloat16, float32")


def parse_input_args(args: Any, where: str) -> InputArgs | None:
    """Validate a group's ``input_activations``: int8, dynamic per token or static per tensor."""
    if args is None:
        return None
    if not isinstance(args, Mapping):
        raise ConfigError(f"{where}: expected an object or null, found {args!r}")
    bits = _int_type(args, where, "activations")
    if bits != 8:
        raise UnsupportedFormatError(f"{where}.num_bits: {bits}-bit activations are not supported; supported: 8")
    if args.get("actorder") not in (None, False):
        raise ConfigError(f"{where}.actorder: activation ordering does not apply to input activations")
    strategy = _strategy(args, where)
    dynamic = config_field(args, "dynamic", (bool, str), False, where)
    if dynamic is True and strategy == "token":
        return InputArgs(dynamic=True, symmetric=config_field(args, "symmetric", bool, True, where))
    if dynamic is False and strategy == "tensor":
        return InputArgs(dynamic=False, symmetric=config_field(args, "symmetric", bool, True, where))
    raise UnsupportedFormatError(
        f"{where}: input activations with strategy '{strategy}' and dynamic={dynamic!r} are not supported; "
        "supported: strategy 'token' with dynamic true, strategy 'tensor' with dynamic false")


# ---- presets (config groups given as a list of targets) --------------------

def _preset(name: str) -> dict[str, Any] | None:
    """The int presets of compressed-tensors' quant_scheme.py, as config dicts."""
    key = name.upper()
    if key in ("W8A8", "INT8"):
        return {"weights": {"num_bits": 8, "strategy": "channel"},
                "input_activations": {"num_bits": 8, "strategy": "token", "dynamic": True}}
    if key == "W4A16_ASYM":
        return {"weights": {"num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": False}}
    m = re.fullmatch(r"W([2-8])A(4|8|16)", key)
    if m is None or int(m.group(1)) > int(m.group(2)):
        return None
    scheme: dict[str, Any] = {"weights": {"num_bits": int(m.group(1)), "strategy": "group", "group_size": 128}}
    if m.group(2) != "16":
        scheme["input_activations"] = {"num_bits": int(m.group(2)), "strategy": "token", "dynamic": True}
    return scheme


# ---- the whole config ------------------------------------------------------

def _infer_format(inputs_quantized: bool) -> str:
    # compressed-tensors' infer_module_format for int weights: int-quantized wins when
    # the inputs are quantized too, else pack-quantized.
    return "int-quantized" if inputs_quantized else PACKED


def _resolve_format(group_fmt: Any, top_fmt: str | None, inputs_quantized: bool, where: str) -> str:
    if group_fmt is not None and not isinstance(group_fmt, str):
        raise ConfigError(f"{where}.format: expected a string, found {group_fmt!r}")
    fmt = group_fmt or (top_fmt if top_fmt != "mixed-precision" else None) or _infer_format(inputs_quantized)
    if fmt in SUPPORTED_FORMATS:
        return fmt
    why = f" ({UNSUPPORTED_FORMATS[fmt]})" if fmt in UNSUPPORTED_FORMATS else ""
    raise UnsupportedFormatError(
        f"{where}.format: '{fmt}'{why} is not supported; supported: {format_choices(SUPPORTED_FORMATS)}")


def parse_scheme(name: str, raw: Any, top_fmt: str | None) -> Scheme:
    where = f"quantization_config.config_groups.{name}"
    if isinstance(raw, list):
        preset = _preset(name)
        if preset is None:
            raise UnsupportedFormatError(
                f"{where}: preset scheme '{name}' is not supported; supported presets: W8A8, INT8, "
                "W4A16_ASYM, W<2-8>A<4|8|16> (int weights)")
        raw = {"targets": raw, **preset}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a scheme object or a list of targets, found {raw!r}")
    targets = config_field(raw, "targets", list, where=where)
    if not targets or not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"{where}.targets: expected a non-empty list of strings, found {targets!r}")
    if raw.get("output_activations") is not None:
        raise UnsupportedFormatError(f"{where}.output_activations: output quantization is not supported; "
                                     "supported: null")
    if raw.get("weights") is None:
        raise UnsupportedFormatError(
            f"{where}.weights: activation-only quantization (no weight quantization) is not supported; "
            "supported: int weights")
    weights = parse_weight_args(raw["weights"], f"{where}.weights")
    inputs = parse_input_args(raw.get("input_activations"), f"{where}.input_activations")
    fmt = _resolve_format(raw.get("format"), top_fmt, inputs is not None, where)
    return Scheme(name, tuple(targets), weights, inputs, fmt)


def _check_absent(qcfg: Mapping[str, Any], key: str, what: str, empty_ok=lambda v: not v) -> None:
    value = qcfg.get(key)
    if value is not None and not empty_ok(value):
        raise UnsupportedFormatError(f"quantization_config.{key}: {what} is not supported; supported: null or empty")


def _sparsity_is_dense(value: Any) -> bool:
    return not value or (isinstance(value, Mapping) and value.get("format") == "dense")


def _transform_is_empty(value: Any) -> bool:
    return not value or (isinstance(value, Mapping) and not value.get("config_groups"))


@dataclass(frozen=True)
class Target:
    """One target or ignore entry, classified once."""

    text: str
    kind: str  # "name" | "regex" | "class"
    pattern: re.Pattern | None = None

    @classmethod
    def parse(cls, text: str, where: str) -> "Target":
        if text.startswith("re:"):
            try:
                return cls(text, "regex", re.compile(text[3:]))
            except re.error as e:
                raise ConfigError(f"{where}: invalid regular expression {text!r} ({e})") from None
        if re.fullmatch(r"[A-Z][A-Za-z0-9_]*", text):
            return cls(text, "class")
        return cls(text, "name")

    def matches(self, module: str, is_linear: bool) -> bool:
        if self.kind == "regex":
            return self.pattern.match(module) is not None
        if self.kind == "name":
            return module == self.text
        return is_linear and self.text in CLASS_TARGETS


@dataclass(frozen=True)
class Resolution:
    """Why a module is (or is not) quantized."""

    scheme: Scheme | None
    reason: str  # e.g. "target 'Linear' of group_0", "ignored by 'lm_head'", "matched by no target"
    by_name: bool = False  # decided by an exact module name (no class inference involved)


class CTConfig:
    """A parsed compressed-tensors ``quantization_config``."""

    def __init__(self, qcfg: Mapping[str, Any]):
        status = qcfg.get("quantization_status")
        if status not in (None, "compressed"):
            raise UnsupportedFormatError(
                f"quantization_config.quantization_status: '{status}' checkpoints hold fake-quantized float "
                "weights and are not supported; supported: compressed")
        _check_absent(qcfg, "kv_cache_scheme", "KV-cache quantization")
        _check_absent(qcfg, "sparsity_config", "sparsity (other than dense)", _sparsity_is_dense)
        _check_absent(qcfg, "transform_config", "weight/activation transforms", _transform_is_empty)
        top_fmt = config_field(qcfg, "format", str, None)
        groups = config_field(qcfg, "config_groups", dict)
        if not groups:
            raise ConfigError("quantization_config.config_groups: empty; at least one group is needed")
        self.version: str | None = config_field(qcfg, "version", str, None)
        self.format = top_fmt
        self.schemes = [parse_scheme(name, raw, top_fmt) for name, raw in groups.items()]
        ignore = config_field(qcfg, "ignore", list, [])
        self.ignore = [Target.parse(self._string(t, "ignore"), "quantization_config.ignore") for t in ignore]
        # target -> scheme, in first-seen order; a repeated target belongs to the last group naming it
        self.target_scheme: dict[str, Scheme] = {}
        for s in self.schemes:
            for t in s.targets:
                self.target_scheme[t] = s
        self.targets = [Target.parse(t, f"quantization_config.config_groups.{self.target_scheme[t].group}.targets")
                        for t in self.target_scheme]
        for t in self.targets:
            if t.kind == "class" and t.text not in CLASS_TARGETS:
                raise UnsupportedFormatError(
                    f"quantization_config.config_groups.{self.target_scheme[t.text].group}.targets: class "
                    f"'{t.text}' cannot be resolved from tensor names; supported targets: exact module names, "
                    f"'re:' patterns, classes {format_choices(CLASS_TARGETS)}")

    @staticmethod
    def _string(value: Any, field: str) -> str:
        if not isinstance(value, str):
            raise ConfigError(f"quantization_config.{field}: expected strings, found {value!r}")
        return value

    def resolve(self, module: str, is_linear: bool) -> Resolution:
        """The scheme compressed-tensors applies to ``module`` (None if it stays dense)."""
        matched = [t for t in self.targets if t.matches(module, is_linear)]
        if not matched:
            return Resolution(None, "matched by no target")
        for ign in self.ignore:
            if ign.matches(module, is_linear):
                return Resolution(None, f"ignored by '{ign.text}'")
        best = min(matched, key=_precedence)
        scheme = self.target_scheme[best.text]
        return Resolution(scheme, f"target '{best.text}' of {scheme.group}", by_name=best.kind == "name")

    def describe(self) -> str:
        ignore = f"; ignore {len(self.ignore)}" if self.ignore else ""
        return "; ".join(f"{s.group}: {s.summary()}" for s in self.schemes) + ignore


def _precedence(t: Target) -> tuple:
    # compressed-tensors' match_targets: name matches (targets sorted with regexes last), then classes
    return (t.kind == "class", "re:" in t.text, t.text)


def role(module: str) -> str:
    """The module's role: its name with layer / expert indices replaced ('layers.3.mlp' -> 'layers.#.mlp')."""
    return ".".join("#" if p.isdigit() else p for p in module.split("."))


def version_tuple(version: str | None) -> tuple[int, ...] | None:
    """'0.19.0' -> (0, 19, 0); None when absent or unparseable."""
    if not version:
        return None
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None
