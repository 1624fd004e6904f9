"""compressed-tensors (llm-compressor) checkpoints -> canonical ``QuantizedWeight``.

On-disk layout, per quantized module ``<m>`` (checked against compressed-tensors 0.19.0,
0.18.0, 0.17 and 0.9-0.12 sources; N = out_features, K = in_features, b = num_bits,
G = number of scale groups; "signed" values q lie in [-2**(b-1), 2**(b-1) - 1]):

pack-quantized (``PackedQuantizationCompressor``; W4A16, W8A16, any int b in 1..8)
    <m>.weight_packed      int32 [N, ceil(K*b/32)]  packed along dim 1 (input).  Each
                           value is stored unsigned, q + 2**(b-1), as a little-endian
                           bitstream: value j in bits [j*b, (j+1)*b) of the row, word w
                           holding bits [32w, 32w+32) (b = 4: nibble j%8 of word j//8).
                           For b not dividing 32 compressed-tensors <= 0.17 instead kept
                           32//b whole values per word, top bits unused: [N, ceil(K/(32//b))].
    <m>.weight_shape       int64 [2] = [N, K] (the packed width only bounds K).
    <m>.weight_scale       float [N, G] (group: G = K / group_size; channel: [N, 1];
                           tensor: [1]), in the model's dtype.
    <m>.weight_zero_point  asymmetric only.  group/channel: int32 [ceil(N*b/32), G], the
                           zero points z + 2**(b-1) packed along dim 0 (OUTPUT) with the
                           same bitstream rule (compressed-tensors >= 0.9.4; older ones
                           stored them unpacked: int8 [N, G], signed).  tensor strategy:
                           int8 [1], signed, never packed.  Symmetric checkpoints store no
                           zero point (pre-0.9 ones may store zeros).
    <m>.weight_g_idx       int32 [K], actorder "group" only (compressed-tensors <= 0.18):
                           the scale group of each input column, non-monotonic.
                           compressed-tensors applies group j to the columns at positions
                           [j*gs, (j+1)*gs) of argsort(g_idx), which equals g_idx[i] as the
                           group of column i exactly when every group has gs columns.
int-quantized / naive-quantized (``IntQuantizationCompressor`` = ``NaiveQuantizationCompressor``)
    <m>.weight             int8 [N, K], signed q (any b <= 8: W8A8, and W4A8 with 4-bit q).
    <m>.weight_scale       as above (W8A8: per channel [N, 1] or per tensor [1]).
    <m>.weight_zero_point  asymmetric only: int8 [N, G] (tensor: [1]), signed, unpacked.
Both formats, when the group quantizes inputs (``input_activations``):
    dynamic, strategy token: nothing stored (scale per token at run time).
    static, strategy tensor: <m>.input_scale float [1]; <m>.input_zero_point int8 [1]
                           only when asymmetric (signed).
    <m>.bias stays a plain float tensor.

Dequantization (compressed-tensors' ``dequantize``): w = (q - z) * s with signed q
and z, z = 0 when symmetric.  Canonical form: codes = q + 2**(b-1) (which is exactly
the stored value for pack-quantized), zeros = z + 2**(b-1) (the stored value when
packed), symmetric -> zeros None (implicit 2**(b-1)); (codes - zeros) = (q - z).
Per-tensor scales and zero points are expanded to per channel (exact).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from quill.canonical import FLOAT_DTYPES, ActivationQuant, QuantizedWeight
from quill.errors import CheckpointError, ConfigError, UnsupportedFormatError
from quill.formats.base import FormatReader, ModuleMap, ModuleTensors
from quill.formats.compressed_tensors.scheme import (
    PACKED,
    CTConfig,
    InputArgs,
    Resolution,
    Scheme,
    WeightArgs,
    role,
    version_tuple,
)
from quill.formats.packing import unpack_int32

INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
# every tensor suffix that marks a module as stored quantized
QUANT_SUFFIXES = frozenset({"weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx",
                            "input_scale", "input_zero_point"})


class CompressedTensorsReader(FormatReader):
    """Reads ``quant_method: compressed-tensors`` checkpoints (pack-, int- and naive-quantized)."""

    method = "compressed-tensors"

    def __init__(self, qcfg: Mapping[str, Any], model_config: Mapping[str, Any]):
        super().__init__(qcfg, model_config)
        self.config = CTConfig(qcfg)
        version = version_tuple(self.config.version)
        # compressed-tensors 0.18 switched b-bit packing (b not dividing 32) to a bitstream
        self.dense_packing: bool | None = None if version is None else version >= (0, 18)
        self._schemes: dict[str, Scheme] = {}

    def describe(self) -> str:
        return f"compressed-tensors ({self.config.describe()})"

    # ---- plan: which modules are quantized, contradictions -------------
    def plan(self, modules: ModuleMap) -> dict[str, list[str]]:
        quantized = {m for m, s in modules.items() if s & QUANT_SUFFIXES}
        quantized_roles = {role(m) for m in quantized}
        plan: dict[str, list[str]] = {}
        for module, suffixes in modules.items():
            is_linear = module in quantized or ("weight" in suffixes and role(module) in quantized_roles)
            res = self.config.resolve(module, is_linear)
            if module in quantized:
                if res.scheme is None:
                    raise ConfigError(
                        f"layer {module}: config contradicts tensors: the checkpoint stores it quantized "
                        f"({', '.join(sorted(suffixes & QUANT_SUFFIXES))}) but quantization_config leaves it "
                        f"dense ({res.reason})")
                plan[module] = _consumed(module, suffixes, res.scheme)
                self._schemes[module] = res.scheme
            elif res.scheme is not None and "weight" in suffixes and (is_linear or res.by_name):
                raise ConfigError(_dense_but_quantized(module, res))
        return plan

    # ---- read: one module --------------------------------------------------
    def read(self, tensors: ModuleTensors) -> QuantizedWeight:
        scheme = self._schemes.get(tensors.module)
        if scheme is None:
            raise CheckpointError(f"layer {tensors.module}: not a quantized module of this checkpoint's plan")
        w = scheme.weights
        if scheme.format == PACKED:
            codes = self._read_packed(tensors, w)
        else:
            codes = _read_unpacked(tensors, w)
        n, k = codes.shape
        group_size = _group_size(tensors.module, w, k)
        scales = _read_scales(tensors, w, n, k // group_size)  # [N, G]
        zeros = self._read_zeros(tensors, w, scheme.format == PACKED, n, scales.shape[1])
        return QuantizedWeight(
            codes=codes, bits=w.bits, group_size=group_size, scales=scales, zeros=zeros,
            g_idx=_read_g_idx(tensors, w, k) if w.stores_g_idx else None, dtype=scales.dtype,
            bias=tensors.get_optional("bias", dtype=FLOAT_DTYPES, shape=[n]),
            activation=_read_activation(tensors, scheme.inputs))

    def _straddle(self, bits: int, count: int, words: int, what: str) -> bool:
        """Which packing a b-bit run of ``count`` values in ``words`` int32 words uses (see module doc)."""
        dense, legacy = -(-count * bits // 32), -(-count // (32 // bits))
        if words == dense and (words != legacy or 32 % bits == 0):  # b | 32: both layouts are the same
            return True
        if words == legacy and words != dense:
            return False
        if words == dense:  # both layouts have this width: only the writer's version tells
            if self.dense_packing is None:
                raise CheckpointError(
                    f"{what}: {bits}-bit packing of {count} values is ambiguous without a readable "
                    f"quantization_config.version (found {self.config.version!r})")
            return self.dense_packing
        expected = f"{dense}" if dense == legacy else f"{dense} (compressed-tensors >= 0.18) or {legacy} (<= 0.17)"
        raise CheckpointError(f"{what}: {words} int32 words do not hold {count} {bits}-bit values; expected {expected}")

    def _read_packed(self, t: ModuleTensors, w: WeightArgs) -> torch.Tensor:
        packed = t.get("weight_packed", dtype=torch.int32)
        shape = t.get("weight_shape", dtype=INT_DTYPES)
        if packed.dim() != 2 or shape.shape != (2,):
            raise UnsupportedFormatError(
                f"layer {t.module}: weight_packed {list(packed.shape)} / weight_shape {list(shape.shape)}: only 2-D "
                "weights are supported (fused 3-D expert tensors are not); supported: weight_packed [N, words], "
                "weight_shape [2]")
        n, k = (int(v) for v in shape.tolist())
        if n != packed.shape[0] or k <= 0:
            raise CheckpointError(
                f"layer {t.module}: weight_shape {[n, k]} does not match weight_packed {list(packed.shape)} "
                "(rows must equal out_features)")
        what = f"layer {t.module}: tensor '{t.module}.weight_packed'"
        straddle = self._straddle(w.bits, k, packed.shape[1], what)
        return unpack_int32(packed, w.bits, dim=1, count=k, what=what, straddle=straddle)  # [N, K] = q + 2**(b-1)

    def _read_zeros(self, t: ModuleTensors, w: WeightArgs, packed_format: bool, n: int,
                    groups: int) -> torch.Tensor | None:
        """int16 [N, G] canonical zeros (z + 2**(b-1)), or None when symmetric."""
        if not t.has("weight_zero_point"):
            if w.symmetric:
                return None
            raise CheckpointError(
                f"layer {t.module}: tensor '{t.module}.weight_zero_point' is missing; asymmetric weights need it")
        zp = t.get("weight_zero_point", dtype=INT_DTYPES)
        name = f"{t.module}.weight_zero_point"
        if w.strategy == "tensor":
            if zp.numel() != 1:
                raise CheckpointError(f"layer {t.module}: tensor '{name}' has shape {list(zp.shape)}, expected [1]")
            _check_signed(zp, w.bits, t.module, name)
            zeros = (zp.reshape(1, 1).to(torch.int16) + (1 << (w.bits - 1))).expand(n, 1)
        elif packed_format and zp.dtype == torch.int32:
            words = -(-n * w.bits // 32)
            if zp.dim() != 2 or zp.shape[1] != groups:
                raise CheckpointError(
                    f"layer {t.module}: tensor '{name}' has shape {list(zp.shape)}, expected [{words}, {groups}] "
                    "(zero points packed along the output dimension)")
            what = f"layer {t.module}: tensor '{name}'"
            straddle = self._straddle(w.bits, n, zp.shape[0], what)
            zeros = unpack_int32(zp, w.bits, dim=0, count=n, what=what, straddle=straddle).to(torch.int16)
        else:  # unpacked signed zero points (naive/int formats, pack-quantized before 0.9.4)
            if tuple(zp.shape) != (n, groups):
                raise CheckpointError(
                    f"layer {t.module}: tensor '{name}' has shape {list(zp.shape)}, expected [{n}, {groups}]")
            _check_signed(zp, w.bits, t.module, name)
            zeros = zp.to(torch.int16) + (1 << (w.bits - 1))
        if w.symmetric:
            if bool((zeros != (1 << (w.bits - 1))).any()):
                raise ConfigError(
                    f"layer {t.module}: config contradicts tensors: weights are symmetric but '{name}' holds "
                    "nonzero zero points")
            return None
        return zeros.contiguous()


def _consumed(module: str, suffixes: frozenset[str], scheme: Scheme) -> list[str]:
    """Check a quantized module's tensors against its scheme; the suffixes it consumes."""
    w, fmt = scheme.weights, scheme.format
    main = ["weight_packed", "weight_shape"] if fmt == PACKED else ["weight"]
    required = [*main, "weight_scale"]
    optional = ["bias", "weight_zero_point"]
    if not w.symmetric:
        required.append("weight_zero_point")
    if w.stores_g_idx:
        required.append("weight_g_idx")
    if scheme.inputs is not None and not scheme.inputs.dynamic:
        required.append("input_scale")
        (optional if scheme.inputs.symmetric else required).append("input_zero_point")
    where = scheme.label()
    missing = [s for s in required if s not in suffixes]
    if missing:
        raise CheckpointError(
            f"layer {module}: tensor '{module}.{missing[0]}' is missing; {where} stores "
            f"{', '.join(dict.fromkeys(required))}")
    unexpected = sorted(suffixes - set(required) - set(optional))
    if unexpected:
        raise ConfigError(
            f"layer {module}: config contradicts tensors: '{module}.{unexpected[0]}' is not part of {where}, "
            f"which stores {', '.join(dict.fromkeys(required))} (and optionally bias)")
    return [s for s in dict.fromkeys(required + optional) if s in suffixes]


def _dense_but_quantized(module: str, res: Resolution) -> str:
    return (f"layer {module}: config contradicts tensors: quantization_config quantizes it ({res.reason}: "
            f"{res.scheme.summary()}) but the checkpoint stores a dense 'weight' without weight_scale; "
            "add it to quantization_config.ignore if it is meant to stay dense")


def _read_unpacked(t: ModuleTensors, w: WeightArgs) -> torch.Tensor:
    """int8 [N, K] signed q -> uint8 codes q + 2**(b-1)."""
    q = t.get("weight", dtype=torch.int8)
    if q.dim() != 2:
        raise UnsupportedFormatError(
            f"layer {t.module}: tensor '{t.module}.weight' has shape {list(q.shape)}; only 2-D weights are supported")
    _check_signed(q, w.bits, t.module, f"{t.module}.weight")
    return (q.to(torch.int16) + (1 << (w.bits - 1))).to(torch.uint8)


def _check_signed(q: torch.Tensor, bits: int, module: str, name: str) -> None:
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
        raise CheckpointError(
            f"layer {module}: tensor '{name}' holds values in [{int(q.min())}, {int(q.max())}], outside the "
            f"signed {bits}-bit range [{lo}, {hi}]")


def _group_size(module: str, w: WeightArgs, k: int) -> int:
    if w.strategy != "group":
        return k
    if k % w.group_size:
        raise ConfigError(
            f"layer {module}: group_size {w.group_size} does not divide in_features {k}; supported: a divisor of "
            "in_features (compressed-tensors cannot dequantize it either)")
    return w.group_size


def _read_scales(t: ModuleTensors, w: WeightArgs, n: int, groups: int) -> torch.Tensor:
    """float [N, G] in the stored dtype (per tensor expanded to per channel)."""
    name = f"{t.module}.weight_scale"
    if w.strategy == "tensor":
        s = t.get("weight_scale", dtype=FLOAT_DTYPES)
        if s.numel() != 1:
            raise CheckpointError(f"layer {t.module}: tensor '{name}' has shape {list(s.shape)}, expected [1] "
                                  "(strategy tensor)")
        return s.reshape(1, 1).expand(n, 1).contiguous()
    return t.get("weight_scale", dtype=FLOAT_DTYPES, shape=[n, groups]).contiguous()


def _read_g_idx(t: ModuleTensors, w: WeightArgs, k: int) -> torch.Tensor | None:
    """int32 [K] act-order groups; None when compressed-tensors would ignore them (all -1)."""
    name = f"{t.module}.weight_g_idx"
    g = t.get("weight_g_idx", dtype=INT_DTYPES, shape=[k]).to(torch.int64)
    if bool((g == -1).all()):  # never initialized: compressed-tensors falls back to column order
        return None
    groups = k // w.group_size
    if int(g.min()) < 0 or int(g.max()) >= groups:
        raise CheckpointError(
            f"layer {t.module}: tensor '{name}' holds groups in [{int(g.min())}, {int(g.max())}], "
            f"expected [0, {groups})")
    counts = torch.bincount(g, minlength=groups)
    if bool((counts != w.group_size).any()):
        j = int((counts != w.group_size).nonzero()[0])
        raise CheckpointError(
            f"layer {t.module}: tensor '{name}' assigns {int(counts[j])} columns to group {j}, expected "
            f"group_size {w.group_size} for every group")
    return g.to(torch.int32)


def _read_activation(t: ModuleTensors, inputs: InputArgs | None) -> ActivationQuant | None:
    if inputs is None:
        return None
    if inputs.dynamic:
        return ActivationQuant(bits=8, dynamic=True, symmetric=inputs.symmetric)
    s = t.get("input_scale", dtype=FLOAT_DTYPES)
    if s.numel() != 1:
        raise CheckpointError(
            f"layer {t.module}: tensor '{t.module}.input_scale' has shape {list(s.shape)}, expected [1] (per tensor)")
    scale = float(s.reshape(-1)[0].float())
    if not scale > 0 or scale == float("inf"):
        raise CheckpointError(f"layer {t.module}: tensor '{t.module}.input_scale' is {scale}, "
                              "expected a positive scale")
    zero = 0
    if t.has("input_zero_point"):
        zp = t.get("input_zero_point", dtype=INT_DTYPES)
        if zp.numel() != 1:
            raise CheckpointError(f"layer {t.module}: tensor '{t.module}.input_zero_point' has shape "
                                  f"{list(zp.shape)}, expected [1]")
        _check_signed(zp, 8, t.module, f"{t.module}.input_zero_point")
        zero = int(zp.reshape(-1)[0])
        if inputs.symmetric and zero != 0:
            raise ConfigError(f"layer {t.module}: config contradicts tensors: input activations are symmetric but "
                              f"'{t.module}.input_zero_point' is {zero}")
    return ActivationQuant(bits=8, dynamic=False, symmetric=inputs.symmetric, scale=scale,
                           zero_point=None if inputs.symmetric else zero)
