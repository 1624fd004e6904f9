"""Kernels from ATen's own CPU ops: the portable fast path and the native kernels' baseline.

* 4-bit: ``_weight_int4pack_mm_for_cpu``, which computes ``(q - 8) * s + z`` per
  group with a float ``z``.  Any canonical 4-bit weight maps onto it exactly:
  ``(q - zero) * s + m = (q - 8) * s + ((8 - zero) * s + m)``.  Its group size
  must be 32..256, so larger groups (and per-channel) repeat their scales.
* 8-bit symmetric per-channel: ``_weight_int8pack_mm`` on ``codes - 128``.
* anything else: dequantize once to bfloat16 and ``matmul``.

Act-order is resolved once in ``prepare`` by sorting the input columns by
group; ``apply`` then gathers the input columns in that order.  int8
activations are emulated (quantize-dequantize, then the same float path): this
kernel is exact, not fast, for W8A8/W4A8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quill.canonical import ActivationQuant, QuantizedWeight
from quill.kernels.activation import fake_quantize_activations
from quill.kernels.base import LinearKernel
from quill.kernels.config import ActKind, LinearLayerConfig

INT4PACK_GROUPS = (256, 128, 64, 32)
INT4PACK_INNER_K_TILES = 8
_N_ALIGN = 16  # _convert_weight_to_int4pack_for_cpu needs N % 16 == 0


@dataclass
class TorchState:
    path: str  # "int4pack" | "int8pack" | "dense"
    weight: torch.Tensor  # int4pack: uint8 packed; int8pack: int8 [N, K]; dense: bf16 [N, K]
    scales: torch.Tensor | None  # int4pack: float32 [G, Npad, 2]; int8pack: float32 [N]
    group_size: int
    out_features: int
    perm: torch.Tensor | None  # int64 [K]: input column order (act-order), or None
    activation: ActivationQuant | None


def _sort_act_order(w: QuantizedWeight) -> tuple[QuantizedWeight, torch.Tensor | None]:
    """Columns sorted by group so groups are contiguous; None perm if that is not possible."""
    if w.g_idx is None:
        return w, None
    perm, counts = w.group_order()
    if bool((counts != w.group_size).any()) or w.num_groups * w.group_size != w.in_features:
        return w, None  # unequal groups: the dense path handles any g_idx
    return w.with_(codes=w.codes[:, perm].contiguous(), g_idx=None), perm


_DEQUANT_CHUNK = 1 << 20  # weights per slice: bounds the float32 temporaries of a large layer


def _dequantize_bf16(w: QuantizedWeight) -> torch.Tensor:
    """bfloat16 [out, in], dequantized a slice of rows at a time.

    A whole-matrix float32 dequantization of a large layer (a 49152-row
    embedding used as lm_head) would briefly need several float32 copies of it.
    """
    out = torch.empty(w.out_features, w.in_features, dtype=torch.bfloat16)
    step = max(1, _DEQUANT_CHUNK // max(1, w.in_features))
    for r0 in range(0, w.out_features, step):
        rows = slice(r0, r0 + step)
        out[rows] = w.take_rows(torch.arange(rows.start, min(rows.stop, w.out_features))).dequantize()
    return out


def _int4pack_group(group_size: int) -> int | None:
    return next((g for g in INT4PACK_GROUPS if group_size % g == 0), None)


class TorchKernel(LinearKernel):
    name = "torch"

    @classmethod
    def can_implement(cls, cfg: LinearLayerConfig) -> str | None:
        if cfg.act == ActKind.INT8_GROUP:
            return "int8 activations with one scale per group run on the native and reference kernels only"
        return None  # the dense path runs any layer

    @classmethod
    def prepare(cls, weight: QuantizedWeight, cfg: LinearLayerConfig) -> TorchState:
        w, perm = _sort_act_order(weight)
        act_order_unresolved = weight.g_idx is not None and perm is None
        if w.bits == 4 and not act_order_unresolved and _int4pack_group(w.group_size):
            return cls._prepare_int4(w, perm)
        if w.bits == 8 and w.symmetric and w.offsets is None and w.per_channel and not act_order_unresolved:
            codes = (w.codes.to(torch.int16) - 128).to(torch.int8).contiguous()
            return TorchState("int8pack", codes, w.scales[:, 0].float().contiguous(), w.group_size,
                              w.out_features, perm, w.activation)
        dense = _dequantize_bf16(weight)
        return TorchState("dense", dense, None, weight.group_size, weight.out_features, None, weight.activation)

    @classmethod
    def _prepare_int4(cls, w: QuantizedWeight, perm: torch.Tensor | None) -> TorchState:
        n, k = w.out_features, w.in_features
        tg = _int4pack_group(w.group_size)
        rep = w.group_size // tg
        s = w.scales.float()
        zero = torch.full_like(s, 8.0) if w.zeros is None else w.zeros.float()
        z = (8.0 - zero) * s
        if w.offsets is not None:
            z = z + w.offsets.float()
        s, z = s.repeat_interleave(rep, dim=1), z.repeat_interleave(rep, dim=1)  # [N, K/tg]
        npad = -(-n // _N_ALIGN) * _N_ALIGN
        codes = w.codes.to(torch.int32)
        if npad != n:  # padded rows: code 8, scale 0 -> contribute nothing
            codes = torch.cat([codes, torch.full((npad - n, k), 8, dtype=torch.int32)])
            s = torch.cat([s, torch.zeros(npad - n, s.shape[1])])
            z = torch.cat([z, torch.zeros(npad - n, z.shape[1])])
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.contiguous(), INT4PACK_INNER_K_TILES)
        sz = torch.stack([s.T, z.T], dim=-1).contiguous()  # [K/tg, Npad, 2]
        return TorchState("int4pack", packed, sz, tg, n, perm, w.activation)

    @classmethod
    def apply(cls, state: TorchState, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)  # [M, K]
        if state.activation is not None:
            x2 = fake_quantize_activations(x2, state.activation).to(x.dtype)
        if state.perm is not None:
            x2 = x2[:, state.perm]
        if state.path == "int4pack":
            dt = x2.dtype if x2.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
            y = torch._weight_int4pack_mm_for_cpu(x2.to(dt).contiguous(), state.weight, state.group_size,
                                                  state.scales.to(dt))[:, : state.out_features]
        elif state.path == "int8pack":
            dt = x2.dtype if x2.dtype in (torch.float32, torch.bfloat16) else torch.float32
            y = torch._weight_int8pack_mm(x2.to(dt).contiguous(), state.weight, state.scales.to(dt))
        else:
            y = x2.to(torch.bfloat16) @ state.weight.T
        y = y.float()
        if bias is not None:
            y = y + bias.float()
        return y.reshape(*lead, y.shape[-1]).to(x.dtype)  # -1 is ambiguous for 0 rows
