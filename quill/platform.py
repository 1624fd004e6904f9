"""What CPU quill runs on: vendor, microarchitecture, ISA flags, cores, caches.

Parsed from ``/proc/cpuinfo`` text (and sysfs for caches), so every decision
made from it is testable with recorded cpuinfo samples.  The ISA level is chosen
once, here, and kernels read it from the :class:`Platform` they are given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

# ISA flags quill cares about, as /proc/cpuinfo spells them.
ISA_FLAGS = (
    "avx2", "fma", "f16c",
    "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
)


@dataclass(frozen=True)
class Platform:
    """A CPU as kernels see it. Immutable; build with :func:`detect` or :func:`parse_cpuinfo`."""

    vendor: str = "unknown"  # "AMD", "Intel" or "unknown"
    model_name: str = ""
    family: int | None = None
    model: int | None = None
    microarch: str = "unknown"  # e.g. "zen3", "zen4", "sapphire_rapids"
    flags: frozenset[str] = field(default_factory=frozenset)
    physical_cores: int = 1
    logical_cpus: int = 1
    cache_bytes: tuple[tuple[str, int], ...] = ()  # (("L1d", n), ("L2", n), ("L3", n)) per instance

    def has(self, *flags: str) -> bool:
        return all(f in self.flags for f in flags)

    @property
    def is_zen(self) -> bool:
        return self.vendor == "AMD" and self.microarch.startswith("zen")

    @property
    def isa_level(self) -> str:
        """The best kernel ISA level this CPU runs: amx > avx512_vnni > avx512 > avx_vnni > avx2 > scalar."""
        if self.has("amx_tile", "amx_int8", "avx512_vnni", "avx512bw", "avx512vl"):
            return "amx"
        if self.has("avx512f", "avx512bw", "avx512vl", "avx512_vnni"):
            return "avx512_vnni"
        if self.has("avx512f", "avx512bw", "avx512vl"):
            return "avx512"
        if self.has("avx2", "fma", "f16c", "avx_vnni"):
            return "avx_vnni"
        if self.has("avx2", "fma", "f16c"):
            return "avx2"
        return "scalar"

    def cache(self, level: str) -> int | None:
        return dict(self.cache_bytes).get(level)


def _microarch(vendor: str, family: int | None, model: int | None, flags: frozenset[str]) -> str:
    if vendor == "AMD" and family is not None:
        if family == 0x17:
            return "zen2" if model is not None and model >= 0x30 else "zen"
        if family == 0x19:
            # Zen 3: models 00-0F, 20-2F, 40-5F; Zen 4: 10-1F, 60-7F, A0-AF
            if model is not None and (0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF):
                return "zen4"
            return "zen3"
        if family == 0x1A:
            return "zen5"
    if vendor == "Intel":
        if "amx_tile" in flags:
            return "sapphire_rapids"
        if "avx512f" in flags:
            return "skylake_avx512"
        if "avx_vnni" in flags:
            return "alder_lake"
        return "intel"
    return "unknown"


def parse_cpuinfo(text: str, cache_bytes: tuple[tuple[str, int], ...] = ()) -> Platform:
    """Build a Platform from /proc/cpuinfo text (x86 layout)."""
    procs: list[dict[str, str]] = []
    cur: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if cur:
                procs.append(cur)
                cur = {}
            continue
        key, _, val = line.partition(":")
        cur[key.strip()] = val.strip()
    if cur:
        procs.append(cur)
    first = procs[0] if procs else {}
    vendor_id = first.get("vendor_id", "")
    vendor = {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}.get(vendor_id, "unknown")
    flags = frozenset(first.get("flags", "").split())
    family = int(first["cpu family"]) if first.get("cpu family", "").isdigit() else None
    model = int(first["model"]) if first.get("model", "").isdigit() else None
    cores = {(p.get("physical id", "0"), p.get("core id", str(i))) for i, p in enumerate(procs)}
    return Platform(
        vendor=vendor, model_name=first.get("model name", ""), family=family, model=model,
        microarch=_microarch(vendor, family, model, flags), flags=flags,
        physical_cores=max(1, len(cores)), logical_cpus=max(1, len(procs)), cache_bytes=cache_bytes,
    )


def _sysfs_caches(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> tuple[tuple[str, int], ...]:
    out = []
    for idx in sorted(root.glob("index*")):
        try:
            level = (idx / "level").read_text().strip()
            kind = (idx / "type").read_text().strip()
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction":
            continue
        name = f"L{level}d" if level == "1" else f"L{level}"
        mult = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}.get(size[-1], 1)
        out.append((name, int(size.rstrip("KMG")) * mult))
    return tuple(out)


def detect() -> Platform:
    """The CPU this process runs on."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return Platform(logical_cpus=os.cpu_count() or 1, physical_cores=os.cpu_count() or 1)
    return parse_cpuinfo(text, _sysfs_caches())
