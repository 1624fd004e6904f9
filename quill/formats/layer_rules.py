"""Per-layer quantization schemes, the override rules that pick them, and the plan step they drive.

GPTQModel's ``dynamic`` (GPTQ checkpoints) and AutoRound's ``extra_config`` say
the same thing: "this module uses other bits / group_size / sym, or stays
dense".  They differ only in how a rule's key matches a module name, so both
parse into one :class:`OverrideRules` and resolve through :func:`apply_overrides`:

* ``dynamic``: keys ``+:regex`` / bare ``regex`` override, ``-:regex`` keeps the
  module dense; ``re.match`` (anchored at the start), first matching key in
  file order wins (GPTQModel ``dynamic_get``; vLLM does the same).
* ``extra_config``: a key equal to a module name of the checkpoint matches that
  module only (exact first); every other key is a regex tried with
  ``re.search`` in file order, first match with a non-empty entry wins
  (auto-round ``inference/utils.py:_expand_regex_config``).

In both, an entry with ``bits >= 16`` keeps the module dense.

The tensors decide which modules are quantized (a ``qweight`` is stored); the
config decides their parameters.  A module the config keeps dense but that is
stored quantized is a contradiction and is refused in ``plan``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from quill.errors import CheckpointError, ConfigError, UnsupportedFormatError
from quill.formats.base import ModuleMap, config_field


@dataclass(frozen=True)
class LayerScheme:
    """How one linear layer is quantized, as its config says."""

    bits: int
    group_size: int  # -1 (or 0): per-channel
    sym: bool | None = None  # None: the config does not say (then the tensors decide)
    desc_act: bool = False


@dataclass(frozen=True)
class Dense:
    """The config keeps a module unquantized; ``why`` names the field that says so."""

    why: str


# ---- override rules -----------------------------------------------------------

@dataclass(frozen=True)
class _Rule:
    key: str  # as written in the config, for messages
    pattern: re.Pattern | None  # None: exact module name ``key``
    anchored: bool  # re.match (dynamic) or re.search (extra_config)
    overrides: Mapping[str, Any] | Dense

    def matches(self, module: str) -> bool:
        if self.pattern is None:
            return module == self.key
        found = self.pattern.match(module) if self.anchored else self.pattern.search(module)
        return found is not None


class OverrideRules:
    """An ordered list of per-module rules; :meth:`lookup` returns the first that applies."""

    def __init__(self, rules: Iterable[_Rule] = ()):
        self.rules = list(rules)
        self._exact = {r.key: r for r in self.rules if r.pattern is None}

    def __bool__(self) -> bool:
        return bool(self.rules)

    def lookup(self, module: str) -> tuple[str, Mapping[str, Any] | Dense] | None:
        """``(key, overrides or Dense)`` of the rule for ``module``, or None when no rule applies."""
        exact = self._exact.get(module)
        if exact is not None:
            return exact.key, exact.overrides
        for rule in self.rules:
            if rule.pattern is not None and rule.matches(module):
                return rule.key, rule.overrides
        return None


def _compile(key: str, where: str) -> re.Pattern:
    try:
        return re.compile(key)
    except re.error as e:
        raise ConfigError(f"{where}: key {key!r} is not a valid regular expression ({e})") from None


def _entry(value: Any, key: str, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}[{key!r}]: expected an object of overrides, found {value!r}")
    return value


def parse_dynamic(dynamic: Any, where: str = "quantization_config.dynamic") -> OverrideRules:
    """GPTQModel ``dynamic``: ``{"+:regex" | "regex": {...}, "-:regex": {}}``."""
    if dynamic is None:
        return OverrideRules()
    if not isinstance(dynamic, Mapping):
        raise ConfigError(f"{where}: expected an object mapping regexes to overrides, found {dynamic!r}")
    rules = []
    for key, value in dynamic.items():
        entry = _entry(value, key, where)
        if key.startswith("-:"):
            rules.append(_Rule(key, _compile(key[2:], where), True, Dense(f"{where} rule {key!r} skips it")))
        else:
            raw = key[2:] if key.startswith("+:") else key
            rules.append(_Rule(key, _compile(raw, where), True, entry))
    return OverrideRules(rules)


def parse_extra_config(extra: Any, module_names: Iterable[str],
                       where: str = "quantization_config.extra_config") -> OverrideRules:
    """AutoRound ``extra_config``: exact module names first, other keys as regexes (``re.search``)."""
    if extra is None:
        return OverrideRules()
    if not isinstance(extra, Mapping):
        raise ConfigError(f"{where}: expected an object mapping layer names to overrides, found {extra!r}")
    names = set(module_names)
    rules = []
    for key, value in extra.items():
        entry = _entry(value, key, where)
        if key in names:
            rules.append(_Rule(key, None, False, entry))
        elif entry:  # auto-round ignores empty regex entries
            rules.append(_Rule(key, _compile(key, where), False, entry))
    return OverrideRules(rules)


def apply_overrides(base: LayerScheme, overrides: Mapping[str, Any] | Dense, where: str) -> LayerScheme | Dense:
    """The scheme after one rule's overrides (``bits >= 16`` -> Dense); refuses what quill cannot read."""
    if isinstance(overrides, Dense):
        return overrides
    bits = config_field(overrides, "bits", int, base.bits, where)
    if bits >= 16:
        return Dense(f"{where} sets bits={bits}")
    data_type = config_field(overrides, "data_type", str, "int", where)
    check_int_data_type(data_type, f"{where}.data_type")
    check_weight_only(overrides, where)
    return replace(
        base, bits=bits,
        group_size=config_field(overrides, "group_size", int, base.group_size, where),
        sym=config_field(overrides, "sym", bool, base.sym, where),
        desc_act=config_field(overrides, "desc_act", bool, base.desc_act, where))


def resolve_scheme(base: LayerScheme, rules: OverrideRules, module: str, where: str) -> LayerScheme | Dense:
    """``base`` with the first applicable rule of ``rules`` applied."""
    found = rules.lookup(module)
    if found is None:
        return base
    key, overrides = found
    return apply_overrides(base, overrides, f"{where}[{key!r}]")


def check_int_data_type(data_type: str, where: str) -> None:
    if data_type.lower() not in ("int", "int_sym", "int_asym"):
        raise UnsupportedFormatError(f"{where}: data_type {data_type!r} is not supported; supported: int")


def check_weight_only(cfg: Mapping[str, Any], where: str) -> None:
    """auto-round's act_bits < 16 means quantized activations (W4A8 ...), which these layouts cannot carry."""
    act_bits = config_field(cfg, "act_bits", (int, float), 16, where)
    if act_bits < 16:
        raise UnsupportedFormatError(
            f"{where}.act_bits: {act_bits} (quantized activations) is not supported for this format; "
            "supported: 16 or more (weight-only)")


def refuse_rotation(qcfg: Mapping[str, Any], where: str = "quantization_config") -> None:
    """auto-round's Hadamard/SpinQuant rotations need online transforms quill does not implement."""
    for key in ("rotation_config", "spinquant_config"):
        if qcfg.get(key):
            raise UnsupportedFormatError(
                f"{where}.{key}: rotated (Hadamard/SpinQuant) checkpoints are not supported; "
                "supported: checkpoints without a rotation")


def check_plain_int_weights(qcfg: Mapping[str, Any], where: str = "quantization_config") -> None:
    """The checks every GPTQ/AWQ-layout config shares: no rotation, integer data type, weight-only."""
    refuse_rotation(qcfg, where)
    check_int_data_type(config_field(qcfg, "data_type", str, "int", where), f"{where}.data_type")
    check_weight_only(qcfg, where)


# ---- module names -------------------------------------------------------------

def matches_name(module: str, pattern: str) -> bool:
    """Whether ``pattern`` (a module name or a regex) names ``module`` or one of its parents.

    A plain name matches whole dotted components (``lm_head`` matches ``lm_head``
    and ``model.lm_head``; ``mlp.gate`` matches ``layers.0.mlp.gate`` but not
    ``layers.0.mlp.gate_proj``, unlike a bare substring test).  A key with regex
    syntax is searched as a regex.
    """
    if any(c in pattern for c in "*+?^$()[]{}|\\"):
        try:
            return re.search(pattern, module) is not None
        except re.error:
            return False
    return f".{pattern}." in f".{module}."


def is_lm_head(module: str) -> bool:
    return module.rpartition(".")[2] == "lm_head"


def block_prefixes(value: Any, where: str) -> list[str] | None:
    """``block_name_to_quantize`` / ``to_quant_block_names``: comma string or (nested) list -> prefixes."""
    if value is None:
        return None
    if isinstance(value, str):
        return [p.strip() for p in value.split(",") if p.strip()]
    if isinstance(value, list):
        out = []
        for item in value:
            if isinstance(item, str):
                out.append(item)
            elif isinstance(item, list) and item and all(isinstance(s, str) for s in item):
                out.append(_common_prefix(item))  # a list of block names: their shared parent
            else:
                raise ConfigError(f"{where}: expected block names (strings), found {item!r}")
        return out
    raise ConfigError(f"{where}: expected a comma-separated string or a list of block names, found {value!r}")


def _common_prefix(names: list[str]) -> str:
    first, last = min(names), max(names)
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:n].rstrip(".")


def in_blocks(module: str, prefixes: list[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


# ---- plan ------------------------------------------------------------------------

def plan_packed_modules(
    modules: ModuleMap,
    required: tuple[str, ...],
    optional: tuple[str, ...],
    scheme_for: Callable[[str], LayerScheme | Dense],
    method: str,
    lm_head_expected: Callable[[str], str | None] = lambda m: None,
) -> tuple[dict[str, list[str]], dict[str, LayerScheme]]:
    """The plan shared by packed-int32 formats (GPTQ, AWQ, AutoRound).

    A module storing ``required[0]`` (``qweight``) is quantized.  Returns the
    suffixes each consumes and its resolved scheme.  Raises when the config
    keeps a stored-quantized module dense, when a quantized module carries
    tensors the format does not define, or when ``lm_head_expected(module)``
    (a reason string) says a dense ``lm_head`` should have been quantized.
    """
    plan: dict[str, list[str]] = {}
    schemes: dict[str, LayerScheme] = {}
    marker = required[0]
    for module, suffixes in modules.items():
        if marker not in suffixes and any(s in suffixes for s in required[1:]):
            raise CheckpointError(
                f"layer {module}: tensor '{module}.{marker}' is missing from the checkpoint, but "
                f"{sorted(f'{module}.{s}' for s in set(required[1:]) & set(suffixes))} are there; {method} layers "
                f"store {', '.join(required)}")
        if marker not in suffixes:
            why = lm_head_expected(module) if is_lm_head(module) and "weight" in suffixes else None
            if why:
                raise ConfigError(f"layer {module}: {why}, but the checkpoint stores it unquantized "
                                  f"('{module}.weight', no '{marker}')")
            continue
        scheme = scheme_for(module)
        if isinstance(scheme, Dense):
            raise ConfigError(
                f"layer {module}: stored quantized ('{module}.{marker}') but {scheme.why}, i.e. keeps it "
                "unquantized; the config contradicts the tensors")
        missing = [s for s in required if s not in suffixes]
        if missing:
            raise CheckpointError(
                f"layer {module}: tensor(s) {[f'{module}.{s}' for s in missing]} missing from the checkpoint; "
                f"{method} layers store {', '.join(required)} (and optionally {', '.join(optional)})")
        extra = sorted(set(suffixes) - set(required) - set(optional))
        if extra:
            raise CheckpointError(
                f"layer {module}: unexpected tensors {[f'{module}.{s}' for s in extra]} beside '{marker}'; "
                f"{method} layers store {', '.join(required + optional)}")
        plan[module] = [s for s in required + optional if s in suffixes]
        schemes[module] = scheme
    return plan, schemes
