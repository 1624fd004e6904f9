"""AutoRound / Intel Neural Compressor checkpoints (``quant_method: auto-round``) -> canonical weights.

AutoRound has no tensor layout of its own for integer weights: ``packing_format`` says
which one it borrowed, and this reader hands each layer to that format's converter
(:func:`~quill.formats.gptq.gptq_to_canonical` or
:func:`~quill.formats.awq.awq_to_canonical`), whose module docstrings
describe the tensors.

``packing_format`` (auto-round 0.15.1, ``inference/backend.py`` and ``convert_model.py``):

* "auto_round:auto_gptq" (the default, and what a symmetric "auto_round" export is
  renamed to), "auto_round:gptq", "auto_gptq", "gptq", "auto": GPTQ layout, v1 zeros
  (stored minus one; ``qlinear_torch_zp``).
* "auto_round" (asymmetric exports), "auto_round:gptqmodel": GPTQ layout, true zeros
  (``qlinear_torch``; auto-round lists them as GPTQ_FORMAT_NO_ZP).
* "auto_round:auto_awq", "auto_round:awq", "auto_awq", "awq": AutoAWQ GEMM layout (4-bit).

Anything else (llm_compressor, fp8, mx/nv fp, mlx, gguf packings) is refused.

Which layers are quantized (auto-round ``inference/convert_model.py:get_layer_config``):

* ``extra_config`` overrides bits / group_size / sym / data_type per layer: a key equal
  to a module name matches it exactly, first; other keys are regexes searched in file
  order (see layer_rules).  bits >= 16 keeps the layer dense.
* ``block_name_to_quantize`` (``to_quant_block_names``, ``quant_block_list``; a
  comma-separated string or a list): layers outside these blocks stay dense unless
  extra_config lists them; ``lm_head`` is quantized only when extra_config lists it.

The stored tensors decide which modules are quantized; a stored-quantized module the
config keeps dense, or a dense ``lm_head`` the config quantizes, is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quill.canonical import QuantizedWeight
from quill.errors import ConfigError, UnsupportedFormatError
from quill.formats import awq, gptq
from quill.formats.base import FormatReader, ModuleMap, ModuleTensors, config_field
from quill.formats.layer_rules import (
    Dense,
    LayerScheme,
    OverrideRules,
    apply_overrides,
    block_prefixes,
    check_plain_int_weights,
    in_blocks,
    is_lm_head,
    parse_extra_config,
    plan_packed_modules,
)

# packing_format -> (layout, GPTQ v1 zeros)
PACKING_FORMATS: dict[str, tuple[str, bool]] = {
    "auto_round:auto_gptq": ("gptq", True), "auto_round:gptq": ("gptq", True), "auto_gptq": ("gptq", True),
    "gptq": ("gptq", True), "auto": ("gptq", True),
    "auto_round": ("gptq", False), "auto_round:gptqmodel": ("gptq", False),
    "auto_round:auto_awq": ("awq", False), "auto_round:awq": ("awq", False), "auto_awq": ("awq", False),
    "awq": ("awq", False),
}
DEFAULT_PACKING = "auto_round:auto_gptq"
EXTRA = "quantization_config.extra_config"


class AutoRoundReader(FormatReader):
    """``quant_method: auto-round`` checkpoints in GPTQ or AWQ packing."""

    method = "auto-round"

    def __init__(self, qcfg: Mapping[str, Any], model_config: Mapping[str, Any]):
        super().__init__(qcfg, model_config)
        where = "quantization_config"
        check_plain_int_weights(qcfg, where)
        self.packing = str(config_field(qcfg, "packing_format", str, DEFAULT_PACKING, where)).lower()
        if self.packing not in PACKING_FORMATS:
            raise UnsupportedFormatError(
                f"{where}.packing_format: '{self.packing}' is not supported; supported: "
                f"{', '.join(PACKING_FORMATS)}")
        self.layout, self.v1 = PACKING_FORMATS[self.packing]
        self.base = LayerScheme(bits=config_field(qcfg, "bits", int, where=where),
                                group_size=config_field(qcfg, "group_size", int, where=where),
                                sym=config_field(qcfg, "sym", bool, None, where))
        self._check_bits(self.base, f"{where}.bits")
        self.blocks = self._block_names(qcfg, where)
        self.extra_config = qcfg.get("extra_config")
        if self.extra_config is not None and not isinstance(self.extra_config, Mapping):
            raise ConfigError(f"{EXTRA}: expected an object mapping layer names to overrides, "
                              f"found {self.extra_config!r}")
        self.rules = OverrideRules()
        self.schemes: dict[str, LayerScheme] = {}

    @staticmethod
    def _block_names(qcfg: Mapping[str, Any], where: str) -> list[str] | None:
        for key in ("block_name_to_quantize", "to_quant_block_names", "quant_block_list"):
            if qcfg.get(key) is not None:
                return block_prefixes(qcfg[key], f"{where}.{key}")
        return None

    def _check_bits(self, scheme: LayerScheme, where: str) -> None:
        supported = awq.AWQ_BITS if self.layout == "awq" else gptq.GPTQ_BITS
        if scheme.bits not in supported:
            raise UnsupportedFormatError(
                f"{where}: bits={scheme.bits} is not supported with packing_format '{self.packing}'; "
                f"supported: {', '.join(map(str, supported))}")

    def scheme_for(self, module: str) -> LayerScheme | Dense:
        """The resolved scheme of ``module``: extra_config first, then the block and lm_head rules."""
        found = self.rules.lookup(module)
        if found is None:
            if is_lm_head(module):
                return Dense(f"{EXTRA} does not list it (auto-round quantizes lm_head only when it does)")
            if self.blocks is not None and not in_blocks(module, self.blocks):
                return Dense(f"it lies outside block_name_to_quantize {self.blocks} and {EXTRA} does not list it")
            return self.base
        key, overrides = found
        scheme = apply_overrides(self.base, overrides, f"{EXTRA}[{key!r}]")
        if not isinstance(scheme, Dense):
            self._check_bits(scheme, f"layer {module} ({EXTRA}[{key!r}])")
        return scheme

    def _lm_head_expected(self, module: str) -> str | None:
        found = self.rules.lookup(module)
        if found is None or isinstance(self.scheme_for(module), Dense):
            return None
        return f"{EXTRA}[{found[0]!r}] quantizes it"

    def plan(self, modules: ModuleMap) -> dict[str, list[str]]:
        self.rules = parse_extra_config(self.extra_config, modules.keys(), EXTRA)
        fmt = awq if self.layout == "awq" else gptq
        plan, self.schemes = plan_packed_modules(modules, fmt.REQUIRED, fmt.OPTIONAL, self.scheme_for,
                                                 f"AutoRound ({self.packing})", self._lm_head_expected)
        return plan

    def read(self, tensors: ModuleTensors) -> QuantizedWeight:
        s = self.schemes.get(tensors.module)
        if s is None:
            raise ConfigError(f"layer {tensors.module}: not a quantized layer of this checkpoint's plan")
        if self.layout == "awq":
            return awq.awq_to_canonical(tensors, s.bits, s.group_size, s.sym)
        return gptq.gptq_to_canonical(tensors, s.bits, s.group_size, self.v1, s.sym)

    def describe(self) -> str:
        b = self.base
        sym = {True: "sym", False: "asym", None: "sym unstated"}[b.sym]
        extra = f", {len(self.extra_config)} extra_config entries" if self.extra_config else ""
        return f"auto-round ({self.packing}), {b.bits}-bit, group {b.group_size}, {sym}{extra}"
