"""The inverse of the compressed-tensors reader: canonical weight -> compressed-tensors tensors and config.

Used by round-trip tests and for writing synthetic checkpoints; the layout is the
one documented in :mod:`quill.formats.compressed_tensors.reader`.
"""

from __future__ import annotations

from typing import Any

import torch

from quill.canonical import QuantizedWeight
from quill.errors import ConfigError
from quill.formats.compressed_tensors.scheme import PACKED, SUPPORTED_FORMATS
from quill.formats.packing import pack_int32


def weight_strategy(qw: QuantizedWeight, per_tensor: bool = False) -> str:
    """compressed-tensors strategy for ``qw``: tensor (if asked and possible), channel or group."""
    if per_tensor:
        if not qw.per_channel or bool((qw.scales != qw.scales[0, 0]).any()) or (
                qw.zeros is not None and bool((qw.zeros != qw.zeros[0, 0]).any())):
            raise ConfigError(f"{qw.name}: per-tensor storage needs one scale and zero point for the whole weight")
        return "tensor"
    return "channel" if qw.per_channel and qw.g_idx is None else "group"


def to_compressed_tensors(
    qw: QuantizedWeight,
    fmt: str = PACKED,
    per_tensor: bool = False,
    legacy_packing: bool = False,
    unpacked_zero_points: bool = False,
) -> dict[str, torch.Tensor]:
    """The tensors compressed-tensors stores for one module, keyed by suffix ('weight_packed', ...).

    Args:
        fmt: pack-quantized, int-quantized or naive-quantized.
        per_tensor: store one scale (and zero point) for the whole weight (strategy tensor).
        legacy_packing: for 3-bit, compressed-tensors <= 0.17's 10-values-per-word layout.
        unpacked_zero_points: pack-quantized before 0.9.4: int8 [N, G] signed zero points.
    """
    if fmt not in SUPPORTED_FORMATS:
        raise ConfigError(f"format '{fmt}' cannot be written; supported: {', '.join(SUPPORTED_FORMATS)}")
    qw.validate()
    strategy = weight_strategy(qw, per_tensor)
    half = 1 << (qw.bits - 1)
    out: dict[str, torch.Tensor] = {}
    if fmt == PACKED:
        out["weight_packed"] = pack_int32(qw.codes, qw.bits, dim=1, straddle=not legacy_packing)  # [N, words]
        out["weight_shape"] = torch.tensor([qw.out_features, qw.in_features], dtype=torch.int64)
    else:
        out["weight"] = (qw.codes.to(torch.int16) - half).to(torch.int8)  # [N, K] signed q
    out["weight_scale"] = qw.scales[:1, :1].reshape(1).clone() if strategy == "tensor" else qw.scales.clone()
    if qw.zeros is not None:
        out["weight_zero_point"] = _zero_points(qw, fmt, strategy, legacy_packing, unpacked_zero_points)
    if qw.g_idx is not None:
        out["weight_g_idx"] = qw.g_idx.to(torch.int32).clone()
    if qw.bias is not None:
        out["bias"] = qw.bias.clone()
    act = qw.activation
    if act is not None and not act.dynamic:
        out["input_scale"] = torch.tensor([act.scale], dtype=qw.scales.dtype)
        if not act.symmetric:
            out["input_zero_point"] = torch.tensor([act.zero_point or 0], dtype=torch.int8)
    return out


def _zero_points(qw: QuantizedWeight, fmt: str, strategy: str, legacy: bool, unpacked: bool) -> torch.Tensor:
    half = 1 << (qw.bits - 1)
    if strategy == "tensor":
        return (qw.zeros[:1, :1].reshape(1) - half).to(torch.int8)  # never packed
    if fmt == PACKED and not unpacked:
        return pack_int32(qw.zeros, qw.bits, dim=0, straddle=not legacy)  # [words(N), G], stored z + 2**(b-1)
    return (qw.zeros - half).to(torch.int8)  # [N, G] signed


def scheme_config(
    qw: QuantizedWeight,
    fmt: str | None = PACKED,
    targets: tuple[str, ...] = ("Linear",),
    per_tensor: bool = False,
    act_order: str | None = None,
) -> dict[str, Any]:
    """One config group describing ``qw`` as llm-compressor writes it (``fmt=None`` omits the format)."""
    strategy = weight_strategy(qw, per_tensor)
    if qw.g_idx is not None:
        act_order = "group"
    weights = {
        "num_bits": qw.bits, "type": "int", "symmetric": qw.zeros is None, "strategy": strategy,
        "group_size": qw.group_size if strategy == "group" else None, "dynamic": False,
        "actorder": act_order, "block_structure": None, "observer": "minmax",
    }
    inputs = None
    if qw.activation is not None:
        a = qw.activation
        inputs = {"num_bits": 8, "type": "int", "symmetric": a.symmetric, "dynamic": a.dynamic,
                  "strategy": "token" if a.dynamic else "tensor", "group_size": None}
    group: dict[str, Any] = {"targets": list(targets), "weights": weights, "input_activations": inputs,
                             "output_activations": None}
    if fmt is not None:
        group["format"] = fmt
    return group


def quantization_config(
    groups: dict[str, dict[str, Any]],
    ignore: list[str] | None = None,
    fmt: str | None = None,
    version: str = "0.19.0",
) -> dict[str, Any]:
    """A whole ``quantization_config`` around some config groups."""
    if fmt is None:
        formats = {g.get("format") if isinstance(g, dict) else None for g in groups.values()}
        fmt = formats.pop() if len(formats) == 1 and None not in formats else "mixed-precision"
    return {
        "quant_method": "compressed-tensors", "format": fmt, "config_groups": groups, "ignore": ignore or [],
        "quantization_status": "compressed", "kv_cache_scheme": None, "sparsity_config": {},
        "transform_config": {}, "global_compression_ratio": None, "version": version,
    }
