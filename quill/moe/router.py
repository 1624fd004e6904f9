"""Routers: router logits -> the top-k experts of every token and their weights."""

from __future__ import annotations

import torch

from quill import native
from quill.errors import ModelError, format_choices

SCORING = ("softmax",)


def route(logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax",
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights float32 [T, k], ids int64 [T, k]).

    Scores are computed in float32 (as transformers does, whatever the model
    dtype); ``renormalize`` divides the k selected scores by their sum
    (Mixtral always, Qwen-MoE when ``norm_topk_prob``).  With the native
    kernels built, the extension's ``moe_route`` computes them (the k largest
    logits, ties to the lower id; probabilities in double, rounded once): the
    native decode step routes with the same function, so both give the same bits.
    """
    if scoring != "softmax":
        raise ModelError(f"router scoring '{scoring}' is not supported; supported: {format_choices(SCORING)}")
    ext = native.load().module
    if ext is not None and logits.dim() == 2 and 0 < top_k <= logits.shape[-1]:
        return ext.moe_route(logits.float().contiguous(), top_k, renormalize)
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
