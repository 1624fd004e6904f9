"""Every quantized linear of a checkpoint, once per token, in file order (a decode step's weight traffic).

Not a model benchmark (no attention, norms or sampling): it isolates what the kernels
do with a real model's layer shapes, which for small models are far from the
bandwidth-friendly 4096-wide ones.  Kernels are compared interleaved, run by run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quill.formats.checkpoint import open_checkpoint
from quill.kernels import KernelPolicy, KernelSelector, build_quant_linear
from quill.platform import Platform


@dataclass
class LinearsResult:
    label: str
    layers: int
    weight_bytes: int
    ms_per_token: float
    kernels: dict[str, int]  # kernel name -> layers it runs

    @property
    def gbs(self) -> float:
        return self.weight_bytes / self.ms_per_token / 1e6


def run(path, platform: Platform, policies: dict[str, KernelPolicy], tokens: int = 10, runs: int = 5,
        activation: str | None = None, log: Callable[[str], None] = print) -> list[LinearsResult]:
    """ms per token of every quantized linear of ``path`` under each kernel policy (bf16 inputs, M = 1)."""
    weights = list(open_checkpoint(path).quantized_layers())
    nbytes = sum(qw.storage_bytes() for _, qw in weights)
    setups = []
    for label, policy in policies.items():
        selector = KernelSelector(platform, policy, exact_float=activation == "exact")
        layers = [build_quant_linear(qw, selector, activation) for _, qw in weights]
        xs = {n: torch.randn(1, n).to(torch.bfloat16) for n in {lin.in_features for lin in layers}}  # [1, K]
        kernels: dict[str, int] = {}
        for lin in layers:
            kernels[lin.kernel_name] = kernels.get(lin.kernel_name, 0) + 1
        setups.append((label, layers, xs, kernels, []))

    def step(layers, xs) -> float:
        t = time.perf_counter()
        for _ in range(tokens):
            for lin in layers:
                lin(xs[lin.in_features])
        return (time.perf_counter() - t) / tokens

    for _, layers, xs, _, _ in setups:
        step(layers, xs)  # warm-up
    for _ in range(runs):
        for _, layers, xs, _, samples in setups:
            samples.append(step(layers, xs))
    out = []
    for label, layers, _, kernels, samples in setups:
        r = LinearsResult(label, len(layers), nbytes, statistics.median(samples) * 1e3, kernels)
        out.append(r)
        log(f"{label:<8} {r.layers} linears, {nbytes / 1e6:.1f} MB: {r.ms_per_token:.2f} ms per token "
            f"({r.gbs:.1f} GB/s); kernels {r.kernels}")
    return out
