"""``quill info``: the CPU as quill sees it, which kernels can run on it, and which native ISA variants
were built (and why the others were not)."""

from __future__ import annotations

from pathlib import Path

from quill.errors import ConfigError
from quill.platform import CPUINFO_PATH, ISA_FLAGS, Platform, detect, parse_cpuinfo


def register(sub) -> None:
    p = sub.add_parser("info", help="show the CPU, its ISA level and the kernels available on it")
    p.add_argument("--cpuinfo", type=Path, default=CPUINFO_PATH,
                   help="read this cpuinfo text instead of /proc/cpuinfo (e.g. a recorded one from another machine)")
    p.set_defaults(func=run)


def kernel_status(name: str, platform: Platform) -> str | None:
    """Why kernel ``name`` cannot run on ``platform`` (including a failed import), or None when it can."""
    from quill.kernels.selection import kernel_class  # torch: only when the command runs (quill --help stays fast)

    try:
        kernel = kernel_class(name)
    except (ImportError, OSError) as e:  # a native kernel whose extension was not built, a missing library
        return f"cannot be loaded: {type(e).__name__}: {e}"
    return kernel.supported(platform)


def _caches(platform: Platform) -> str:
    shared = dict(platform.cache_shared_cpus)
    parts = []
    for level, size in platform.cache_bytes:
        text = f"{level} {size // 1024} KiB"
        if shared.get(level, 1) > 1:
            text += f" (shared by {shared[level]} CPUs)"
        parts.append(text)
    return ", ".join(parts) or "unknown"


def _platform_lines(platform: Platform) -> list[str]:
    ident = ", ".join(x for x in (
        platform.vendor, platform.microarch,
        f"family {platform.family} model {platform.model}" if platform.family is not None else "",
        f"stepping {platform.stepping}" if platform.stepping is not None else "") if x)
    cores = (f"{platform.physical_cores} physical, {platform.logical_cpus} logical, {platform.sockets} socket(s), "
             f"{platform.threads_per_core} thread(s) per core")
    if platform.usable_cpus is not None and platform.usable_cpus != platform.logical_cpus:
        cores += f"; this process may use {platform.usable_cpus}"
    return [
        f"cpu:        {platform.model_name or 'unknown'} ({ident})",
        f"cores:      {cores}",
        f"caches:     {_caches(platform)}",
        "isa flags:  " + (" ".join(f for f in ISA_FLAGS if platform.has(f)) or "none of " + " ".join(ISA_FLAGS)),
        f"isa level:  {platform.isa_level}",
    ]


def report(platform: Platform) -> str:
    """The text ``quill info`` prints for ``platform``."""
    from quill.kernels.selection import KERNELS, LINEAR_KERNELS

    lines = _platform_lines(platform)
    priority = LINEAR_KERNELS.default_priorities(platform)
    statuses = {name: kernel_status(name, platform) for name in KERNELS}
    lines.append(f"kernels (tried in this order on {platform.isa_level}; "
                 "each layer runs on the first that accepts it):")
    lines += [_kernel_line(name, statuses[name], platform) for name in priority]
    others = sorted(set(KERNELS) - set(priority))
    if others:
        lines.append("other registered kernels (used only when forced with QUILL_KERNEL):")
        lines += [_kernel_line(name, statuses[name], platform) for name in others]
    return "\n".join(lines)


def _kernel_line(name: str, reason: str | None, platform: Platform) -> str:
    from quill.kernels.selection import kernel_class

    if reason is not None:
        return f"  {name:<14} unavailable: {reason}"
    variant = getattr(kernel_class(name), "variant", None)  # optional: the ISA variant that runs here
    return f"  {name:<14} available" + (f" ({variant(platform)})" if variant else "")


def native_report(host: Platform) -> str:
    """The native extension's ISA variants: each built one, and why the others were not (``host``: the CPU
    the build ran on, this one: the build compiles the variants it runs, quill.native.build)."""
    from quill import native

    ext = native.load()
    if ext.module is None:
        return f"native variants: none ({ext.error})"
    built = native.built_variants()
    lines = [f"native variants (built into {Path(ext.module.__file__).name}):"]
    for name, why in native.variant_status(host).items():
        if name in built:
            lines.append(f"  {name}: built")
        else:  # a build with --variants, or one made on another CPU
            lines.append(f"  {name}: not built: {why or 'this CPU runs it; rebuild: python -m quill.native.build'}")
    return "\n".join(lines)


def run(args) -> int:
    if args.cpuinfo == CPUINFO_PATH:
        platform = detect()
    else:  # a recorded text from another machine: its caches and affinity are unknown here
        try:
            platform = parse_cpuinfo(args.cpuinfo.read_text())
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--cpuinfo {args.cpuinfo}: cannot read it ({e}); expected a /proc/cpuinfo text") from e
    print(report(platform))
    print(native_report(detect()))
    return 0
