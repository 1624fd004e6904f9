"""Choosing one implementation by priority list: shared by linear kernels and MoE backends.

A *family* (:class:`Registry`) is data: its implementations by name, its
priority lists per ISA level, the two environment variables a user controls
it with, and the logger its choices go to.  :class:`PrioritySelector` walks
the list for one layer description and returns the first implementation that
is neither disabled nor refusing, or raises one error listing every refusal.

Implementations are classes with ``name``, ``supported(platform) -> reason |
None`` and ``can_implement(cfg) -> reason | None``; the layer description only
needs ``summary()``.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from quill.errors import KernelSelectionError, format_choices
from quill.platform import Platform


@dataclass(frozen=True)
class Registry:
    """One family of interchangeable implementations, chosen per layer."""

    what: str  # "kernel", "MoE backend": used in messages
    entries: Mapping[str, str]  # name -> "module:Class" (imported on first use)
    # ISA level -> names, best first; rows only where a list differs from the level below ("scalar" required)
    priorities: Mapping[str, tuple[str, ...]]
    force_var: str  # environment variable that forces one implementation
    disabled_var: str  # environment variable listing disabled implementations
    logger: str

    def load(self, name: str) -> type:
        if name not in self.entries:
            raise KernelSelectionError(f"unknown {self.what} '{name}'; known {self.what}s: "
                                       f"{format_choices(self.entries)}")
        module, cls = self.entries[name].split(":")
        return getattr(importlib.import_module(module), cls)

    def default_priorities(self, platform: Platform) -> tuple[str, ...]:
        """The row of the platform's ISA level, or of the nearest level below it that has one."""
        return tuple(next(self.priorities[lv] for lv in platform.isa_ladder if lv in self.priorities))

    def policy_from_env(self, environ: Mapping[str, str] | None = None) -> "KernelPolicy":
        """This family's policy from the environment (read here, once, by the caller)."""
        return KernelPolicy.from_env(environ, self.force_var, self.disabled_var)


@dataclass(frozen=True)
class KernelPolicy:
    """What the user asked for: a forced implementation and/or disabled ones."""

    force: str | None = None
    disabled: frozenset[str] = frozenset()
    origin: str = ""  # who forced ``force``, for messages ("" = the environment variable)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, force_var: str = "QUILL_KERNEL",
                 disabled_var: str = "QUILL_DISABLED_KERNELS") -> "KernelPolicy":
        """Read ``force_var`` / ``disabled_var`` (the linear kernels' by default)."""
        env = os.environ if environ is None else environ
        force = env.get(force_var, "").strip() or None
        disabled = frozenset(n.strip() for n in env.get(disabled_var, "").split(",") if n.strip())
        return cls(force, disabled)

    def validate(self, registry: Registry) -> None:
        named = set(self.disabled) | ({self.force} if self.force else set())
        unknown = sorted(n for n in named if n not in registry.entries)
        if unknown:
            where = f"{registry.force_var}/{registry.disabled_var}"
            if self.origin and self.force in unknown:
                where = self.origin
            raise KernelSelectionError(
                f"unknown {registry.what} name(s) {', '.join(unknown)} in {where}; known {registry.what}s: "
                f"{format_choices(registry.entries)}")
        if self.force and self.force in self.disabled:
            raise KernelSelectionError(f"{registry.what} '{self.force}' is both forced ({registry.force_var}) and "
                                       f"disabled ({registry.disabled_var})")


@dataclass(frozen=True)
class Selection:
    """The chosen implementation (``kernel``: a linear kernel or an MoE backend class) and why higher ones refused."""

    kernel: Any
    refusals: tuple[tuple[str, str], ...] = ()
    forced: bool = False

    @property
    def name(self) -> str:
        return self.kernel.name


@dataclass
class PrioritySelector:
    """Chooses an implementation of ``registry`` per layer; logs each distinct choice once.

    Subclasses set ``registry`` and may override :meth:`log_key` (which
    choices count as the same for logging).
    """

    registry: ClassVar[Registry]
    platform: Platform
    policy: KernelPolicy = field(default_factory=KernelPolicy)
    priorities: tuple[str, ...] | None = None  # override the platform's list (tests, benchmarks)
    threads: int | None = None  # the run's threads for native kernels (None: the platform's physical cores)
    _logged: set = field(default_factory=set, init=False, repr=False)

    def __post_init__(self):
        if self.threads is None:
            self.threads = self.platform.default_threads
        elif isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise KernelSelectionError(f"threads must be a positive integer, found {self.threads!r}")
        self.policy.validate(self.registry)
        if self.priorities is None:
            self.priorities = self.registry.default_priorities(self.platform)
        for name in self.priorities:
            self.registry.load(name)  # unknown names fail here, not at the first layer

    def refusal(self, impl: type, cfg: Any) -> str | None:
        """Why ``impl`` cannot run ``cfg`` on this platform, or None."""
        return impl.supported(self.platform) or impl.can_implement(cfg)

    def select(self, cfg: Any, layer: str = "layer") -> Selection:
        reg = self.registry
        if self.policy.force:
            impl = reg.load(self.policy.force)
            reason = self.refusal(impl, cfg)
            if reason:
                by = self.policy.origin or reg.force_var
                raise KernelSelectionError(
                    f"{layer} ({cfg.summary()}): {reg.what} '{impl.name}' was forced by {by} but cannot run it: "
                    f"{reason}")
            return self._chosen(Selection(impl, (), True), cfg, layer)
        refusals: list[tuple[str, str]] = []
        for name in self.priorities:
            if name in self.policy.disabled:
                refusals.append((name, f"disabled by {reg.disabled_var}"))
                continue
            impl = reg.load(name)
            reason = self.refusal(impl, cfg)
            if reason is None:
                return self._chosen(Selection(impl, tuple(refusals)), cfg, layer)
            refusals.append((name, reason))
        lines = "\n".join(f"  - {n}: {r}" for n, r in refusals)
        raise KernelSelectionError(f"{layer} ({cfg.summary()}): no {reg.what} can run this layer:\n{lines}")

    def log_key(self, cfg: Any) -> Hashable:
        return cfg.summary()

    def _chosen(self, sel: Selection, cfg: Any, layer: str) -> Selection:
        key = (sel.name, self.log_key(cfg))
        if key not in self._logged:
            self._logged.add(key)
            why = "; ".join(f"{n}: {r}" for n, r in sel.refusals)
            logging.getLogger(self.registry.logger).info(
                "%s %s for %s (first: %s)%s", self.registry.what, sel.name, cfg.summary(), layer,
                f" [skipped {why}]" if why else "")
        return sel
