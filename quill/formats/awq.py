"""AWQ checkpoints (AutoAWQ GEMM layout, also written by auto-round) -> canonical weights.

On-disk layout of one linear layer ``<m>`` (K = in_features, N = out_features, 4-bit,
G = K / group_size):

    <m>.qweight  int32 [K, N/8]   codes packed along OUT (dim 1), 8 nibbles per word,
                                  interleaved: nibble slot j (bits 4j..4j+3) of word c holds
                                  output column 8c + [0, 2, 4, 6, 1, 3, 5, 7][j]
    <m>.qzeros   int32 [G, N/8]   zero points, packed and interleaved the same way
    <m>.scales   float16/bf16/float32 [G, N]
    <m>.bias     float [N]        optional

    w[n, k] = (q[k, n] - z[k // group_size, n]) * scales[k // group_size, n]

Zero points are stored as they are (no minus-one), in [0, 15].  ``zero_point: false``
exports (auto-round's symmetric AWQ) still store qzeros, all 8; canonical zeros are
None whenever every zero is 8 (exact), and a ``zero_point: false`` config whose qzeros
are not all 8 is refused as contradictory.  No act-order (no g_idx).

``version`` (AutoAWQ): "gemm" (the default) is this layout.  "exllama", "exllamav2" and
"ipex" name AutoAWQ load-time kernels whose modules register the GEMM state dict
unchanged ("These shapes are only for compatibility with the state_dict of
WQLinear_GEMM", awq/modules/linear/exllama*.py; gemm_ipex.py likewise) and repack after
loading, so they are read as GEMM.  "gemv" (qweight [N, K/8] packed along IN),
"gemv_fast" and "marlin" are other layouts and are refused.

Config (quantization_config / quant_config.json): bits or w_bit (4 only), group_size or
q_group_size, zero_point, version, modules_to_not_convert (module names or regexes;
a stored-quantized module they name is a contradiction).
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
    matches_name,
    plan_packed_modules,
)
from quill.formats.packing import unpack_int32

AWQ_BITS = (4,)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # slot j of a word holds column order[j] of its 8
GEMM_VERSIONS = ("gemm", "exllama", "exllamav2", "ipex")
REQUIRED = ("qweight", "qzeros", "scales")
OPTIONAL = ("bias",)


# ---- tensors -> canonical -------------------------------------------------------

def awq_to_canonical(t: ModuleTensors, bits: int, group_size: int, sym: bool | None = None) -> QuantizedWeight:
    """Convert one AWQ-GEMM module (see the module docstring) into a canonical weight.

    ``sym=True`` (``zero_point: false``) is checked against the stored zeros.
    """
    layer = t.module
    check_bits(bits, AWQ_BITS, f"layer {layer}: AWQ GEMM bits")
    scales = t.get("scales", dtype=FLOAT_DTYPES, shape=[None, None])  # [G, N]
    groups, n = scales.shape
    words = -(-n * bits // 32)
    qweight = t.get("qweight", dtype=torch.int32, shape=[None, None])  # [K, N/8]
    if qweight.shape[1] != words or n % (32 // bits):
        raise CheckpointError(
            f"layer {layer}: tensor '{layer}.qweight' has shape {list(qweight.shape)}, expected "
            f"[*, {words}] for out_features {n} (from scales) packed {32 // bits} per int32 at bits={bits}"
            f"{_implied_bits(qweight.shape[1], n)}")
    k = qweight.shape[0]
    qzeros = t.get("qzeros", dtype=torch.int32, shape=[groups, words])  # [G, N/8]
    gs = resolve_group_size(group_size, k, layer)
    if groups != k // gs:
        raise ConfigError(
            f"layer {layer}: tensor '{layer}.scales' has {groups} groups but in_features {k} / group_size "
            f"{gs} = {k // gs}; the config's group_size ({group_size}) contradicts the tensors")

    # unpacking qweight.T along dim 0 reads qweight's own rows: no packed copy, codes come out [N, K]
    codes = unpack_int32(qweight.T, bits, dim=0, count=n, order=AWQ_ORDER, what=f"{layer}.qweight")
    zeros = unpack_int32(qzeros, bits, dim=1, count=n, order=AWQ_ORDER, what=f"{layer}.qzeros")
    zeros = zeros.T.to(torch.int16).contiguous()  # [N, G]
    mid = 1 << (bits - 1)
    if bool((zeros == mid).all()):
        zeros = None
    elif sym:
        found = sorted(set(zeros.unique().tolist()) - {mid})[:8]
        raise ConfigError(
            f"layer {layer}: the config says zero_point=false (symmetric) but '{layer}.qzeros' holds zero "
            f"points {found} besides {mid}")
    return QuantizedWeight(
        codes=codes, bits=bits, group_size=gs, scales=scales.T.contiguous(), zeros=zeros, dtype=scales.dtype,
        bias=t.get_optional("bias", dtype=FLOAT_DTYPES, shape=[n]))


def _implied_bits(words: int, count: int) -> str:
    return " (the tensor is shaped for bits=8)" if words * 4 == count else ""


# ---- the reader ----------------------------------------------------------------------

def awq_version(qcfg: Mapping[str, Any], where: str = "quantization_config") -> str:
    """The AutoAWQ ``version`` if its tensors use the GEMM layout; refuses the others."""
    version = str(config_field(qcfg, "version", str, "gemm", where)).lower()
    if version not in GEMM_VERSIONS:
        raise UnsupportedFormatError(
            f"{where}.version: AWQ '{version}' is not supported (a different tensor layout); supported: "
            f"{', '.join(GEMM_VERSIONS)} (all store the GEMM layout)")
    return version


class AWQReader(FormatReader):
    """``quant_method: awq`` checkpoints: the layout in this module's docstring."""

    method = "awq"

    def __init__(self, qcfg: Mapping[str, Any], model_config: Mapping[str, Any]):
        super().__init__(qcfg, model_config)
        where = "quantization_config"
        check_plain_int_weights(qcfg, where)
        self.version = awq_version(qcfg, where)
        bits = config_field(qcfg, ("bits", "w_bit"), int, where=where)
        if bits not in AWQ_BITS:
            raise UnsupportedFormatError(
                f"{where}.bits: AWQ {self.version} with bits={bits} is not supported; supported: 4")
        zero_point = config_field(qcfg, "zero_point", bool, True, where)
        self.scheme = LayerScheme(bits=bits, group_size=config_field(qcfg, ("group_size", "q_group_size"), int,
                                                                     where=where), sym=not zero_point)
        skip = config_field(qcfg, "modules_to_not_convert", list, [], where)
        if not all(isinstance(s, str) for s in skip):
            raise ConfigError(f"{where}.modules_to_not_convert: expected a list of module names, found {skip!r}")
        self.not_convert = list(skip)

    def scheme_for(self, module: str) -> LayerScheme | Dense:
        for pattern in self.not_convert:
            if matches_name(module, pattern):
                return Dense(f"quantization_config.modules_to_not_convert names it ({pattern!r})")
        return self.scheme

    def plan(self, modules: ModuleMap) -> dict[str, list[str]]:
        plan, _ = plan_packed_modules(modules, REQUIRED, OPTIONAL, self.scheme_for, "AWQ")
        return plan

    def read(self, tensors: ModuleTensors) -> QuantizedWeight:
        s = self.scheme
        return awq_to_canonical(tensors, s.bits, s.group_size, s.sym)

    def describe(self) -> str:
        s = self.scheme
        return f"awq ({self.version}), {s.bits}-bit, group {s.group_size}, {'sym' if s.sym else 'asym'}"
