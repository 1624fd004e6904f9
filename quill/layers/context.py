"""What slots need at load time (kernel choice, dtype, where errors point) and what they report back.

The engine builds one :class:`LoadContext` from the run options and hands it to
every slot; only this package talks to the kernel and MoE selectors.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from quill.kernels import KernelPolicy, KernelSelector
from quill.moe import MOE_REGISTRY, MoESelector
from quill.platform import Platform


@dataclass(frozen=True)
class LayerInfo:
    """How one weight matrix (a linear layer or the embedding) was loaded, for ``quill inspect``."""

    name: str
    # "quantized", "dense", "tied" (lm_head sharing the embedding), "embedding" or "expert" (an MoE expert projection)
    kind: str
    summary: str  # e.g. "W4A16 g128 sym 256x128"
    bits: int | None
    group_size: int | None
    symmetric: bool | None
    kernel: str
    refusals: tuple[tuple[str, str], ...]  # kernels ranked higher that refused, with their reasons
    weight_bytes: int  # as stored in the checkpoint
    num_weights: int
    held_bytes: int = 0  # as the kernel holds it (what a decode step reads); 0 where not tracked (experts)


@dataclass(frozen=True)
class LoadContext:
    """What a slot that builds its own run-time object needs from the loader."""

    selector: KernelSelector  # linear kernels
    moe_selector: MoESelector
    activation: str | None  # the user's activation quantization request ("int8", "int8-group" or None: float)
    dtype: torch.dtype  # compute dtype
    where: str = "checkpoint"  # what errors name as the source (the checkpoint's path)

    @classmethod
    def create(cls, platform: Platform, dtype: torch.dtype, activation: str | None = None,
               kernel: str | None = None, moe_backend: str | None = None, where: str = "checkpoint",
               env: dict | None = None, threads: int | None = None) -> "LoadContext":
        """Selectors from the environment's policies (QUILL_KERNEL, ...), a forced kernel / MoE backend on top;
        ``threads`` (default: the physical cores) is what every native kernel is built with.  ``activation``
        "exact" is float activations exact to float32 rounding: the kernel selector's, not a layer request
        (the layouts, and so the prepacked cache, are those of float activations)."""
        policy = KernelPolicy.from_env(env)
        if kernel is not None:
            policy = KernelPolicy(force=kernel, disabled=policy.disabled - {kernel}, origin="the kernel option")
        moe_policy = MOE_REGISTRY.policy_from_env(env)
        if moe_backend is not None:
            moe_policy = KernelPolicy(force=moe_backend, disabled=moe_policy.disabled - {moe_backend},
                                      origin="the moe_backend option")
        exact = activation == "exact"
        return cls(KernelSelector(platform, policy, threads=threads, exact_float=exact),
                   MoESelector(platform, moe_policy), None if exact else activation, dtype, where)

    @classmethod
    def from_selector(cls, selector: KernelSelector, dtype: torch.dtype, activation: str | None = None,
                      moe_selector: MoESelector | None = None, where: str = "checkpoint") -> "LoadContext":
        """Around an existing kernel selector (the MoE selector defaults to the default policy on its platform)."""
        return cls(selector, moe_selector or MoESelector(selector.platform), activation, dtype, where)

    def choice(self) -> dict:
        """What decides every layer's kernel and layout, as JSON-able data (the prepacked cache's key):
        the kernel and MoE policies, the priority lists if overridden, activation quantization, compute
        dtype, the native ISA variant and a digest of the CPU's flags."""
        def policy(sel):
            return {"force": sel.policy.force, "disabled": sorted(sel.policy.disabled),
                    "priorities": None if sel.priorities is None else list(sel.priorities)}
        flags = hashlib.blake2b(" ".join(sorted(self.platform.flags)).encode(), digest_size=8).hexdigest()
        return {"kernels": policy(self.selector), "moe": policy(self.moe_selector), "activation": self.activation,
                "dtype": str(self.dtype).removeprefix("torch."), "isa": self.native_isa,
                "vendor": self.platform.vendor, "cpu_flags": flags}

    @property
    def platform(self) -> Platform:
        return self.selector.platform

    @property
    def native_isa(self) -> str | None:
        """The native variant every native entry runs on this platform ('avx512', 'avx2'), None without one.

        The one decision (``quill.native.isa_for``): linear and dense kernels take it through their
        layer config, decode attention through the engine's KV cache."""
        from quill import native
        return native.isa_for(self.platform) if native.unsupported(self.platform) is None else None
