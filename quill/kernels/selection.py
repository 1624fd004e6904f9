"""Kernel choice as data: priority lists per ISA level, a user policy, one error listing every refusal.

    selector = KernelSelector(platform, KernelPolicy.from_env())
    choice = selector.select(cfg, layer="model.layers.0.self_attn.q_proj")
    state = choice.kernel.prepare(weight, cfg)

``QUILL_KERNEL=name`` forces one kernel (an error if it cannot run a layer);
``QUILL_DISABLED_KERNELS=a,b`` skips some.  The environment is read once, by
:meth:`KernelPolicy.from_env`, never inside selection.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from quill.errors import KernelSelectionError, format_choices
from quill.kernels.base import LinearKernel
from quill.kernels.config import LinearLayerConfig
from quill.platform import Platform

log = logging.getLogger("quill.kernels")

# Every linear kernel quill knows, by name -> "module:Class" (imported on first use).
KERNELS: dict[str, str] = {
    "zentorch": "quill.kernels.zentorch_ops:ZentorchKernel",
    "zentorch_woq": "quill.kernels.zentorch_ops:ZentorchWoqKernel",
    "torch": "quill.kernels.torch_ops:TorchKernel",
    "reference": "quill.kernels.reference:ReferenceKernel",
}

# Priority lists per ISA level (Platform.isa_level), best first.  Kernels that
# cannot run on a CPU say so through ``supported`` (zentorch: AMD Zen with AVX-512
# only); the lists only say what to try.  Registered kernels listed nowhere
# (zentorch_woq) run only when forced with QUILL_KERNEL.
PRIORITIES: dict[str, tuple[str, ...]] = {
    "amx": ("zentorch", "torch", "reference"),
    "avx512_vnni": ("zentorch", "torch", "reference"),
    "avx512": ("zentorch", "torch", "reference"),
    "avx_vnni": ("zentorch", "torch", "reference"),
    "avx2": ("zentorch", "torch", "reference"),
    "scalar": ("zentorch", "torch", "reference"),
}


def kernel_class(name: str) -> type[LinearKernel]:
    if name not in KERNELS:
        raise KernelSelectionError(f"unknown kernel '{name}'; known kernels: {format_choices(KERNELS)}")
    module, cls = KERNELS[name].split(":")
    return getattr(importlib.import_module(module), cls)


@dataclass(frozen=True)
class KernelPolicy:
    """What the user asked for: a forced kernel and/or disabled kernels."""

    force: str | None = None
    disabled: frozenset[str] = frozenset()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "KernelPolicy":
        env = os.environ if environ is None else environ
        force = env.get("QUILL_KERNEL", "").strip() or None
        disabled = frozenset(n.strip() for n in env.get("QUILL_DISABLED_KERNELS", "").split(",") if n.strip())
        return cls(force, disabled)

    def validate(self) -> None:
        named = set(self.disabled) | ({self.force} if self.force else set())
        unknown = sorted(n for n in named if n not in KERNELS)
        if unknown:
            raise KernelSelectionError(
                f"unknown kernel name(s) {', '.join(unknown)} in QUILL_KERNEL/QUILL_DISABLED_KERNELS; "
                f"known kernels: {format_choices(KERNELS)}")
        if self.force and self.force in self.disabled:
            raise KernelSelectionError(f"kernel '{self.force}' is both forced (QUILL_KERNEL) and disabled "
                                       "(QUILL_DISABLED_KERNELS)")


@dataclass(frozen=True)
class Selection:
    """The chosen kernel and why the ones ranked above it refused."""

    kernel: type[LinearKernel]
    refusals: tuple[tuple[str, str], ...] = ()
    forced: bool = False

    @property
    def name(self) -> str:
        return self.kernel.name


@dataclass
class KernelSelector:
    """Chooses a kernel per layer for one platform and policy; logs each distinct choice once."""

    platform: Platform
    policy: KernelPolicy = field(default_factory=KernelPolicy)
    priorities: tuple[str, ...] | None = None  # override the platform's list (tests, benchmarks)
    _logged: set = field(default_factory=set, init=False, repr=False)

    def __post_init__(self):
        self.policy.validate()
        if self.priorities is None:
            self.priorities = PRIORITIES.get(self.platform.isa_level, PRIORITIES["scalar"])
        for name in self.priorities:
            kernel_class(name)  # unknown names fail here, not at the first layer

    def refusal(self, kernel: type[LinearKernel], cfg: LinearLayerConfig) -> str | None:
        """Why ``kernel`` cannot run ``cfg`` on this platform, or None."""
        return kernel.supported(self.platform) or kernel.can_implement(cfg)

    def select(self, cfg: LinearLayerConfig, layer: str = "layer") -> Selection:
        if self.policy.force:
            kernel = kernel_class(self.policy.force)
            reason = self.refusal(kernel, cfg)
            if reason:
                raise KernelSelectionError(
                    f"{layer} ({cfg.summary()}): kernel '{kernel.name}' was forced by QUILL_KERNEL but cannot "
                    f"run it: {reason}")
            return self._chosen(Selection(kernel, (), True), cfg, layer)
        refusals: list[tuple[str, str]] = []
        for name in self.priorities:
            if name in self.policy.disabled:
                refusals.append((name, "disabled by QUILL_DISABLED_KERNELS"))
                continue
            kernel = kernel_class(name)
            reason = self.refusal(kernel, cfg)
            if reason is None:
                return self._chosen(Selection(kernel, tuple(refusals)), cfg, layer)
            refusals.append((name, reason))
        lines = "\n".join(f"  - {n}: {r}" for n, r in refusals)
        raise KernelSelectionError(f"{layer} ({cfg.summary()}): no kernel can run this layer:\n{lines}")

    def _chosen(self, sel: Selection, cfg: LinearLayerConfig, layer: str) -> Selection:
        key = (sel.name, cfg.bits, cfg.group_size, cfg.symmetric, cfg.has_offsets, cfg.act_order, cfg.act)
        if key not in self._logged:
            self._logged.add(key)
            why = "; ".join(f"{n}: {r}" for n, r in sel.refusals)
            log.info("kernel %s for %s (first: %s)%s", sel.name, cfg.summary(), layer,
                     f" [skipped {why}]" if why else "")
        return sel
