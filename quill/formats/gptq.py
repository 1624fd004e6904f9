"""GPTQ checkpoints (AutoGPTQ, GPTQModel, auto-round's auto_gptq export) -> canonical weights.

On-disk layout of one linear layer ``<m>`` (K = in_features, N = out_features,
b = bits in {2, 3, 4, 8}, G = K / group_size; group_size -1 means G = 1):

    <m>.qweight  int32 [K*b/32, N]   codes packed along IN (dim 0): code (k, n) is the
                                     b-bit field k of column n's little-endian bitstream,
                                     lowest bits first (0x76543210 holds k = 0..7 for 4-bit);
                                     3-bit fields straddle words (32 codes per 3 words)
    <m>.qzeros   int32 [G, N*b/32]   zero points packed along OUT (dim 1), same bit order
    <m>.scales   float16/bf16/float32 [G, N]
    <m>.g_idx    int32 [K]           optional: group of each input column (act-order);
                                     auto-round writes it always, as arange(K) // group_size
    <m>.bias     float [N]           optional

    w[n, k] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n]

Zero points (``checkpoint_format``, default "gptq"):

* "gptq" (v1; AutoGPTQ, GPTQModel's default export, auto-round): the writers store
  ``zero - 1``; symmetric 4-bit stores 7 (0x77777777).  For 2/4/8 bits quill undoes it
  the way GPTQModel converts v1 to v2: add 0x11111111 (0x55555555, 0x01010101) to each
  whole int32 word.  That is the exact inverse of what GPTQModel (v2 -> v1 word
  subtraction) and auto-round (shifted sum of ``zero - 1``) write, including a true
  zero of 0: its field is stored as 15 with a borrow from the next field, and the
  word addition wraps it back to 0 and returns the carry.  The tools' readers differ on
  that one case: auto-round's torch QuantLinear reads stored 15 as zero 16 (mask, then
  +1), AutoGPTQ's CUDA/exllama kernels as 0 without the carry ((z + 1) & 15); all agree
  whenever no stored field is 2**b - 1 (true of every conformance fixture).  3-bit
  fields straddle words, so there (as GPTQModel does) each field is shifted on its own:
  zero = (stored + 1) mod 8.
* "gptq_v2" (GPTQModel): the true zero is stored.

Canonical form: codes [N, K] uint8; zeros int16 [N, G], or None when every zero is
2**(b-1) (exact: that is the symmetric implicit zero); scales [N, G]; g_idx kept only
when it differs from arange(K) // group_size (the trivial one is dropped: exact, and
kernels without act-order support stay usable).  A non-trivial g_idx is honoured even
when desc_act is false, as every tool's dequantization indexes by it.

Config (quantization_config / quantize_config.json): bits, group_size, sym, desc_act,
checkpoint_format ("format" in GPTQModel's spelling), lm_head, dynamic (GPTQModel
per-module overrides, see layer_rules), modules_in_block_to_quantize (informational:
the stored tensors decide which modules are quantized; auto-round has written lists
that omit quantized modules, vLLM #25455), pack_dtype (int32 only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from quill.canonical import FLOAT_DTYPES, QuantizedWeight
from quill.errors import CheckpointError, ConfigError, UnsupportedFormatError
from quill.formats.base import (
    FormatReader,
    ModuleMap,
    ModuleTensors,
    check_bits,
    config_field,
    resolve_group_size,
)
from quill.formats.layer_rules import (
    Dense,
    LayerScheme,
    check_plain_int_weights,
    parse_dynamic,
    plan_packed_modules,
    resolve_scheme,
)
from quill.formats.packing import unpack_int32

GPTQ_BITS = (2, 3, 4, 8)
CHECKPOINT_FORMATS = {"gptq": True, "gptq_v2": False}  # name -> zeros stored minus one (v1)
REQUIRED = ("qweight", "qzeros", "scales")
OPTIONAL = ("g_idx", "bias")
# Adding one to every b-bit field of an int32 word at once (GPTQModel's v1 -> v2 constant).
_ONES = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}


# ---- tensors -> canonical -------------------------------------------------------

def gptq_to_canonical(t: ModuleTensors, bits: int, group_size: int, v1: bool = True,
                      sym: bool | None = None, desc_act: bool = False) -> QuantizedWeight:
    """Convert one GPTQ-layout module (see the module docstring) into a canonical weight.

    ``sym`` (when the config states it) is checked against the stored zeros;
    ``desc_act`` requires a ``g_idx`` tensor.  Only this layer is ever unpacked.
    """
    layer = t.module
    qweight = t.get("qweight", dtype=torch.int32, shape=[None, None])  # [K*b/32, N]
    n = qweight.shape[1]
    scales = t.get("scales", dtype=FLOAT_DTYPES, shape=[None, n])  # [G, N]
    groups = scales.shape[0]
    qzeros = t.get("qzeros", dtype=torch.int32)
    _check_packed_width(layer, "qzeros", qzeros, [groups, None], 1, n, bits)  # [G, N*b/32]
    g_idx = t.get_optional("g_idx", dtype=(torch.int32, torch.int64), shape=[None])
    k = _in_features(layer, qweight, bits, g_idx)
    gs = resolve_group_size(group_size, k, layer)
    if groups != k // gs:
        raise ConfigError(
            f"layer {layer}: tensor '{layer}.scales' has {groups} groups but in_features {k} / group_size "
            f"{gs} = {k // gs}; the config's group_size ({group_size}) contradicts the tensors")
    if desc_act and g_idx is None:
        raise CheckpointError(f"layer {layer}: desc_act is true but tensor '{layer}.g_idx' is missing")

    codes = unpack_int32(qweight.T, bits, dim=1, count=k, what=f"{layer}.qweight")  # [N, K]
    zeros = _unpack_zeros(qzeros, bits, n, v1, f"{layer}.qzeros").T.contiguous()  # [N, G]
    mid = 1 << (bits - 1)
    if bool((zeros == mid).all()):
        zeros = None
    elif sym:
        found = sorted(set(zeros.unique().tolist()) - {mid})[:8]
        raise ConfigError(
            f"layer {layer}: the config says sym=true but '{layer}.qzeros' holds zero points {found} "
            f"besides {mid} (after the {'v1 minus-one' if v1 else 'v2'} convention); symmetric GPTQ stores "
            f"{mid - 1 if v1 else mid} everywhere")
    return QuantizedWeight(
        codes=codes, bits=bits, group_size=gs, scales=scales.T.contiguous(), zeros=zeros,
        g_idx=_nontrivial_g_idx(g_idx, gs), dtype=scales.dtype,
        bias=t.get_optional("bias", dtype=FLOAT_DTYPES, shape=[n]))


def _in_features(layer: str, qweight: torch.Tensor, bits: int, g_idx: torch.Tensor | None) -> int:
    rows = qweight.shape[0]
    if g_idx is not None:
        k = g_idx.shape[0]
        if rows != -(-k * bits // 32):
            raise CheckpointError(
                f"layer {layer}: tensor '{layer}.qweight' has {rows} rows, but g_idx gives in_features {k}, "
                f"which packs into {-(-k * bits // 32)} rows at bits={bits}{_implied_bits(rows, k)}")
        return k
    if rows * 32 % bits:
        raise CheckpointError(
            f"layer {layer}: tensor '{layer}.qweight' has {rows} rows, not a whole number of {bits}-bit "
            f"columns ({bits}-bit GPTQ packs 32 input columns into {bits} rows)")
    return rows * 32 // bits


def _implied_bits(words: int, count: int) -> str:
    """A hint naming the bit width that would explain a packed length, when one does."""
    fits = [str(b) for b in GPTQ_BITS if -(-count * b // 32) == words]
    return f" (the tensor is shaped for bits={' or '.join(fits)})" if fits else ""


def _check_packed_width(layer: str, name: str, t: torch.Tensor, shape: list, dim: int, count: int,
                        bits: int) -> None:
    want = list(shape)
    want[dim] = -(-count * bits // 32)
    if t.dim() != len(want) or any(w is not None and w != s for w, s in zip(want, t.shape)):
        shown = "[" + ", ".join("*" if w is None else str(w) for w in want) + "]"
        hint = _implied_bits(t.shape[dim], count) if t.dim() == len(want) else ""
        raise CheckpointError(
            f"layer {layer}: tensor '{layer}.{name}' has shape {list(t.shape)}, expected {shown} for "
            f"{count} values at bits={bits}{hint}")


def _unpack_zeros(qzeros: torch.Tensor, bits: int, count: int, v1: bool, what: str) -> torch.Tensor:
    """int16 [G, N] true zero points from packed qzeros [G, N*b/32]."""
    if v1 and bits in _ONES:
        # whole-word add in int64, wrapped back to 32 bits (see the module docstring)
        words = ((qzeros.to(torch.int64) & 0xFFFFFFFF) + _ONES[bits]) & 0xFFFFFFFF
        qzeros = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    zeros = unpack_int32(qzeros, bits, dim=1, count=count, what=what).to(torch.int16)
    if v1 and bits not in _ONES:
        zeros = (zeros + 1) % (1 << bits)
    return zeros


def _nontrivial_g_idx(g_idx: torch.Tensor | None, group_size: int) -> torch.Tensor | None:
    if g_idx is None:
        return None
    trivial = torch.arange(g_idx.shape[0], dtype=g_idx.dtype) // group_size
    return None if torch.equal(g_idx, trivial) else g_idx.to(torch.int32).contiguous()


# ---- the reader ----------------------------------------------------------------------

def checkpoint_format_is_v1(qcfg: Mapping[str, Any], where: str = "quantization_config") -> bool:
    """True for v1 ("gptq", zeros stored minus one), False for "gptq_v2"; refuses other layouts."""
    if qcfg.get("is_marlin_format"):
        raise UnsupportedFormatError(
            f"{where}.is_marlin_format: Marlin-repacked GPTQ checkpoints are not supported; supported "
            f"checkpoint_format: {', '.join(CHECKPOINT_FORMATS)}")
    field = "checkpoint_format" if qcfg.get("checkpoint_format") is not None else "format"
    fmt = str(config_field(qcfg, field, str, "gptq", where)).lower()
    if fmt not in CHECKPOINT_FORMATS:
        raise UnsupportedFormatError(
            f"{where}.{field}: '{fmt}' is not supported; supported: {', '.join(CHECKPOINT_FORMATS)}")
    return CHECKPOINT_FORMATS[fmt]


class GPTQReader(FormatReader):
    """``quant_method: gptq`` checkpoints: the layout in this module's docstring."""

    method = "gptq"

    def __init__(self, qcfg: Mapping[str, Any], model_config: Mapping[str, Any]):
        super().__init__(qcfg, model_config)
        where = "quantization_config"
        check_plain_int_weights(qcfg, where)
        pack_dtype = str(config_field(qcfg, "pack_dtype", str, "int32", where))
        if pack_dtype.rpartition(".")[2] != "int32":
            raise UnsupportedFormatError(f"{where}.pack_dtype: '{pack_dtype}' is not supported; supported: int32")
        self.v1 = checkpoint_format_is_v1(qcfg, where)
        self.base = LayerScheme(
            bits=check_bits(config_field(qcfg, "bits", int, where=where), GPTQ_BITS, f"{where}.bits"),
            group_size=config_field(qcfg, "group_size", int, where=where),
            sym=config_field(qcfg, "sym", bool, None, where),
            desc_act=config_field(qcfg, "desc_act", bool, False, where))
        self.lm_head = config_field(qcfg, "lm_head", bool, False, where)
        self.dynamic = parse_dynamic(qcfg.get("dynamic"), f"{where}.dynamic")
        _check_block_modules(qcfg.get("modules_in_block_to_quantize"), f"{where}.modules_in_block_to_quantize")
        self.schemes: dict[str, LayerScheme] = {}

    def scheme_for(self, module: str) -> LayerScheme | Dense:
        """The resolved scheme of ``module`` (global config, then its ``dynamic`` rule)."""
        if module.rpartition(".")[2] == "lm_head" and not self.lm_head:
            return Dense("quantization_config.lm_head is false")
        scheme = resolve_scheme(self.base, self.dynamic, module, "quantization_config.dynamic")
        if not isinstance(scheme, Dense):
            check_bits(scheme.bits, GPTQ_BITS, f"layer {module}: bits")
        return scheme

    def _lm_head_expected(self, module: str) -> str | None:
        if isinstance(self.scheme_for(module), Dense):
            return None
        return "quantization_config.lm_head is true"

    def plan(self, modules: ModuleMap) -> dict[str, list[str]]:
        plan, self.schemes = plan_packed_modules(modules, REQUIRED, OPTIONAL, self.scheme_for, "GPTQ",
                                                 self._lm_head_expected)
        return plan

    def read(self, tensors: ModuleTensors) -> QuantizedWeight:
        s = self.schemes.get(tensors.module) or self.scheme_for(tensors.module)
        if isinstance(s, Dense):
            raise ConfigError(f"layer {tensors.module}: {s.why}, so it is not a quantized layer")
        return gptq_to_canonical(tensors, s.bits, s.group_size, self.v1, s.sym, s.desc_act)

    def describe(self) -> str:
        b = self.base
        sym = {True: "sym", False: "asym", None: "sym unstated"}[b.sym]
        extra = ", dynamic overrides" if self.dynamic else ""
        return (f"gptq ({'v1' if self.v1 else 'v2'} zeros), {b.bits}-bit, group {b.group_size}, {sym}"
                f"{', desc_act' if b.desc_act else ''}{extra}")


def _check_block_modules(value: Any, where: str) -> None:
    """modules_in_block_to_quantize: a list of lists of module names (only its shape is checked)."""
    if value is None:
        return
    items = value if isinstance(value, list) else None
    flat = [] if items is None else [x for item in items for x in (item if isinstance(item, list) else [item])]
    if items is None or not all(isinstance(x, str) for x in flat):
        raise ConfigError(f"{where}: expected a list of lists of module names, found {value!r}")
