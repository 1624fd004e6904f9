"""``quill info``: the CPU as quill sees it, and which kernels can run on it."""

from __future__ import annotations

from quill.kernels.selection import KERNELS, PRIORITIES, kernel_class
from quill.platform import ISA_FLAGS, Platform, detect


def register(sub) -> None:
    p = sub.add_parser("info", help="show the CPU, its ISA level and the kernels available on it")
    p.set_defaults(func=run)


def report(platform: Platform) -> str:
    lines = [
        f"cpu:        {platform.model_name or 'unknown'} ({platform.vendor}, {platform.microarch})",
        f"cores:      {platform.physical_cores} physical, {platform.logical_cpus} logical",
        "caches:     " + (", ".join(f"{k} {v // 1024} KiB" for k, v in platform.cache_bytes) or "unknown"),
        "isa flags:  " + " ".join(f for f in ISA_FLAGS if platform.has(f)),
        f"isa level:  {platform.isa_level}",
        "kernels (priority order):",
    ]
    for name in PRIORITIES.get(platform.isa_level, PRIORITIES["scalar"]):
        cls = kernel_class(name)
        reason = cls.supported(platform)
        variant = getattr(cls, "variant", None)  # optional: which ISA variant runs here
        detail = f" ({variant(platform)})" if reason is None and variant else ""
        lines.append(f"  {name:<14} {'available' + detail if reason is None else 'unavailable: ' + reason}")
    others = sorted(set(KERNELS) - set(PRIORITIES.get(platform.isa_level, ())))
    for name in others:
        lines.append(f"  {name:<14} not in this CPU's priority list")
    return "\n".join(lines)


def run(args) -> int:
    print(report(detect()))
    return 0
