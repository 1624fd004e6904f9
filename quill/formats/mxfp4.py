"""Hugging Face MXFP4 checkpoints (``quant_method: mxfp4``, gpt-oss) -> canonical weights.

gpt-oss keeps every MoE projection of a layer as one stacked pair (transformers
``integrations/mxfp4.py``, ``_convert_moe_packed_tensors``)::

    <experts>.<proj>_blocks  uint8 [E, out, in / 32, 16]  two FP4 E2M1 codes a byte
    <experts>.<proj>_scales  uint8 [E, out, in / 32]      E8M0 exponent, 2 ** (e - 127)
    <experts>.<proj>_bias    float [E, out]                (dense, optional)

    w[e, o, 32 b + 2 j]     = FP4[blocks[e, o, b, j] & 15] * 2 ** (scales[e, o, b] - 127)
    w[e, o, 32 b + 2 j + 1] = FP4[blocks[e, o, b, j] >> 4] * ...

(low nibble first, unlike ggml's MXFP4 whose low nibbles are weights 0..15 of a block).
transformers then transposes to ``[E, in, out]`` for ``x @ W``; the rows here are the
``out`` features, as every canonical weight.

One canonical weight per projection, named ``<experts>.<proj>``, with the E experts'
rows stacked (``[E * out, in]``, expert e is rows ``e * out ... (e + 1) * out``, the bias
likewise): the model splits them (``take_rows``).  The dequantization is
:class:`QuantizedWeight`'s codebook formula with FP4 E2M1 and E8M0 scales: exact.
Everything without a ``_blocks`` / ``_scales`` pair (attention, router, embeddings:
``modules_to_not_convert``) is dense.
"""

from __future__ import annotations

import torch

from quill.canonical import E8M0, FP4_E2M1, QuantizedWeight
from quill.errors import CheckpointError
from quill.formats.base import FormatReader, ModuleMap, ModuleTensors

GROUP = 32
_PAIR = ("blocks", "scales")


class MXFP4Reader(FormatReader):
    """Stacked ``<proj>_blocks`` / ``<proj>_scales`` pairs, one canonical weight per projection."""

    method = "mxfp4"
    suffix_separator = "_"  # tensors are '<proj>_blocks', not '<proj>.blocks'

    def plan(self, modules: ModuleMap) -> dict[str, list[str]]:
        plan: dict[str, list[str]] = {}
        for module, suffixes in modules.items():
            for suffix in suffixes:
                proj, sep, kind = suffix.rpartition("_")
                if not sep or kind not in _PAIR:
                    continue
                other = f"{proj}_{_PAIR[1 - _PAIR.index(kind)]}"
                if other not in suffixes:
                    raise CheckpointError(f"layer {module}.{proj}: tensor '{module}.{suffix}' has no "
                                          f"'{module}.{other}' beside it; MXFP4 needs both _blocks and _scales")
                plan[f"{module}.{proj}"] = list(_PAIR) + (["bias"] if f"{proj}_bias" in suffixes else [])
        return plan

    def read(self, tensors: ModuleTensors) -> QuantizedWeight:
        blocks = tensors.get("blocks", dtype=torch.uint8)
        if blocks.dim() == 3:  # one projection, not stacked experts
            blocks = blocks.unsqueeze(0)
        if blocks.dim() != 4 or blocks.shape[-1] != GROUP // 2:
            raise CheckpointError(f"layer {tensors.module}: tensor '{tensors.module}_blocks' has shape "
                                  f"{list(blocks.shape)}, expected [E, out, in / 32, 16] uint8")
        experts, out, groups, _ = blocks.shape
        scales = tensors.get("scales", dtype=torch.uint8)
        if scales.numel() != experts * out * groups:
            raise CheckpointError(f"layer {tensors.module}: tensor '{tensors.module}_scales' has shape "
                                  f"{list(scales.shape)}, expected [{experts}, {out}, {groups}] beside the blocks")
        return mxfp4_weight(blocks.reshape(experts * out, groups, GROUP // 2), scales.reshape(experts * out, groups),
                            bias=_bias(tensors, experts * out), name=tensors.module)

    def describe(self) -> str:
        return "mxfp4 (FP4 E2M1 experts, E8M0 scale per 32)"


def mxfp4_weight(blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 name: str = "<unnamed>") -> QuantizedWeight:
    """blocks uint8 [out, in / 32, 16] (low nibble = even column) and E8M0 exponents uint8 [out, in / 32]."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(blocks.shape[0], -1)  # interleave
    return QuantizedWeight(codes=codes, bits=4, group_size=GROUP, scales=scales.contiguous().view(E8M0),
                           codebook=FP4_E2M1.clone(), dtype=torch.bfloat16, bias=bias, name=name)


def _bias(tensors: ModuleTensors, rows: int) -> torch.Tensor | None:
    if not tensors.has("bias"):
        return None
    b = tensors.get("bias")
    if b.numel() != rows:
        raise CheckpointError(f"layer {tensors.module}: tensor '{tensors.module}_bias' has shape {list(b.shape)}, "
                              f"expected {rows} values (one per stacked output row)")
    return b.reshape(rows)
