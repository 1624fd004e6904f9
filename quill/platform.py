"""What CPU quill runs on: vendor, microarchitecture, ISA flags, cores, caches.

Parsed from ``/proc/cpuinfo`` text (and sysfs for caches and, where cpuinfo
lacks it, topology), so every decision made from it is testable with recorded
cpuinfo samples and a fake sysfs tree.  The ISA level is chosen once, here, and
kernels read it from the :class:`Platform` they are given.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

log = logging.getLogger("quill.platform")

# ISA flags quill cares about, as /proc/cpuinfo spells them (``quill info`` shows these).
ISA_FLAGS = (
    "avx2", "fma", "f16c",
    "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
    "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
)

# Flags a weaker machine lacks (Platform.limited_to).
# Kernel ISA levels, best first (Platform.isa_level names one).
ISA_LEVELS = ("amx", "avx512_vnni", "avx512", "avx_vnni", "avx2", "scalar")

_ISA_CEILINGS = {
    "avx2": frozenset(f for f in ISA_FLAGS if f.startswith(("avx512", "avx_vnni", "amx"))),
}

ISA_CHOICES = ("native", *_ISA_CEILINGS)  # what --isa / Platform.limited_to take

CPUINFO_PATH = Path("/proc/cpuinfo")
SYSFS_CPU_ROOT = Path("/sys/devices/system/cpu")

_VENDORS = {"AuthenticAMD": "AMD", "GenuineIntel": "Intel", "HygonGenuine": "Hygon"}


@dataclass(frozen=True)
class Platform:
    """A CPU as kernels see it. Immutable; build with :func:`detect` or :func:`parse_cpuinfo`."""

    vendor: str = "unknown"  # "AMD", "Intel", "Hygon" or "unknown"
    model_name: str = ""
    family: int | None = None
    model: int | None = None
    microarch: str = "unknown"  # e.g. "zen3", "zen4", "sapphire_rapids"
    flags: frozenset[str] = field(default_factory=frozenset)
    physical_cores: int = 1
    logical_cpus: int = 1
    cache_bytes: tuple[tuple[str, int], ...] = ()  # (("L1d", n), ("L2", n), ("L3", n)) per instance
    sockets: int = 1
    stepping: int | None = None
    cache_shared_cpus: tuple[tuple[str, int], ...] = ()  # (("L3", 8), ...): logical CPUs sharing one instance
    usable_cpus: int | None = None  # CPUs this process may run on (affinity/cpuset), None when unknown

    def has(self, *flags: str) -> bool:
        """True when every one of ``flags`` is present."""
        return all(f in self.flags for f in flags)

    def missing(self, *flags: str) -> tuple[str, ...]:
        """The subset of ``flags`` this CPU lacks, in the order given (for refusal messages)."""
        return tuple(f for f in flags if f not in self.flags)

    def limited_to(self, isa: str) -> "Platform":
        """This CPU with the ISA flags above ``isa`` removed ('avx2': an AVX2+FMA+F16C machine such
        as Zen 2/3; 'native': as it is), so the variants a weaker CPU would run can be measured and checked."""
        if isa == "native":
            return self
        if isa not in _ISA_CEILINGS:
            raise ValueError(f"unknown ISA ceiling '{isa}'; known: {', '.join(ISA_CHOICES)}")
        return replace(self, flags=self.flags - _ISA_CEILINGS[isa])

    @property
    def default_threads(self) -> int:
        """Threads a run uses unless told: one per physical core, no more than this process may run on (a
        container's cpuset or taskset, where more threads would only take turns on the same CPUs)."""
        return max(1, min(self.physical_cores, self.usable_cpus or self.physical_cores))

    @property
    def is_zen(self) -> bool:
        return self.vendor == "AMD" and self.microarch.startswith("zen")

    @property
    def threads_per_core(self) -> int:
        return max(1, self.logical_cpus // max(1, self.physical_cores))

    @property
    def isa_ladder(self) -> tuple[str, ...]:
        """This CPU's ISA level and every level below it, best first (priority tables are looked up
        down this ladder, so a level needs a row only where its list differs from the one below)."""
        return ISA_LEVELS[ISA_LEVELS.index(self.isa_level):]

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
        """Bytes of one instance of cache ``level`` ("L1d", "L2", "L3"), or None when unknown."""
        return dict(self.cache_bytes).get(level)

    def summary(self) -> str:
        """One line, e.g. 'AMD EPYC 7763 64-Core Processor (AMD zen3, 8 cores / 16 threads, avx2)'."""
        return (f"{self.model_name or 'unknown CPU'} ({self.vendor} {self.microarch}, {self.physical_cores} cores / "
                f"{self.logical_cpus} threads, {self.isa_level})")


# ---- microarchitecture -----------------------------------------------------

# AMD family 0x19 model ranges that are Zen 4 (the rest of the family is Zen 3):
# Genoa/Bergamo/Siena 10-1F and A0-AF, Raphael 60-6F, Phoenix/Hawk Point 70-7F.
_ZEN4_MODELS_19H = ((0x10, 0x1F), (0x60, 0x7F), (0xA0, 0xAF))

# Intel family 6 model numbers -> microarchitecture (server parts first).
_INTEL_FAMILY6 = {
    0x8F: "sapphire_rapids", 0xCF: "emerald_rapids", 0xAD: "granite_rapids", 0xAE: "granite_rapids",
    0xAF: "sierra_forest", 0x6A: "ice_lake_server", 0x6C: "ice_lake_server",
    0x3F: "haswell", 0x3C: "haswell", 0x45: "haswell", 0x46: "haswell",
    0x4F: "broadwell", 0x56: "broadwell", 0x3D: "broadwell", 0x47: "broadwell",
    0x4E: "skylake", 0x5E: "skylake", 0x8E: "kaby_lake", 0x9E: "kaby_lake", 0xA5: "comet_lake",
    0x7D: "ice_lake", 0x7E: "ice_lake", 0x8C: "tiger_lake", 0x8D: "tiger_lake", 0xA7: "rocket_lake",
    0x97: "alder_lake", 0x9A: "alder_lake", 0xB7: "raptor_lake", 0xBA: "raptor_lake", 0xBF: "raptor_lake",
    0xAA: "meteor_lake", 0xAC: "meteor_lake", 0xC5: "arrow_lake", 0xC6: "arrow_lake", 0xBD: "lunar_lake",
}
_INTEL_AMX_PARTS = frozenset({"sapphire_rapids", "emerald_rapids", "granite_rapids"})


def _amd_microarch(family: int, model: int | None) -> str:
    if family == 0x17:  # Zen / Zen+ below model 0x30, Zen 2 from 0x30 (Rome 0x31, Renoir 0x60, Matisse 0x71)
        return "zen2" if model is not None and model >= 0x30 else "zen"
    if family == 0x19:
        if model is not None and any(lo <= model <= hi for lo, hi in _ZEN4_MODELS_19H):
            return "zen4"
        return "zen3"
    if family == 0x1A:
        return "zen5"
    return "unknown"


def _intel_microarch(family: int | None, model: int | None, stepping: int | None, flags: frozenset[str]) -> str:
    if family == 6 and model == 0x55:  # one model number for three server generations, told apart by stepping
        if stepping is not None and stepping >= 10:
            return "cooper_lake"
        return "cascade_lake" if stepping is not None and stepping >= 5 else "skylake_server"
    known = _INTEL_FAMILY6.get(model) if family == 6 else None
    # A KVM guest can report a client model number on a server part (seen: model 167, Rocket Lake's, on a
    # Xeon with AMX and 105 MiB of L3): no client part has AMX, so then the ISA decides.
    if known is not None and ("amx_tile" not in flags or known in _INTEL_AMX_PARTS):
        return known
    # Unknown model (newer than this table, or masked by a hypervisor): guess from the ISA.
    if "amx_tile" in flags:
        return "sapphire_rapids"
    if "avx512f" in flags:
        return "skylake_server"
    if "avx_vnni" in flags:
        return "alder_lake"
    return "intel"


def microarch_of(vendor: str, family: int | None, model: int | None, stepping: int | None = None,
                 flags: frozenset[str] = frozenset()) -> str:
    """Microarchitecture name from CPUID family/model (e.g. AMD 25/1 -> "zen3", Intel 6/143 -> "sapphire_rapids")."""
    if vendor == "AMD" and family is not None:
        return _amd_microarch(family, model)
    if vendor == "Intel":
        return _intel_microarch(family, model, stepping, flags)
    return "unknown"


# ---- /proc/cpuinfo -----------------------------------------------------------

def _split_processors(text: str) -> list[dict[str, str]]:
    """One dict per ``processor`` block (blank-line separated ``key : value`` lines)."""
    procs: list[dict[str, str]] = []
    cur: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if cur:
                procs.append(cur)
                cur = {}
            continue
        key, sep, val = line.partition(":")
        if sep:
            cur[key.strip()] = val.strip()
    if cur:
        procs.append(cur)
    return [p for p in procs if "processor" in p] or procs


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    value = value.strip()
    return int(value) if value.isdigit() else None


def _count_cores(procs: list[dict[str, str]]) -> tuple[int | None, int]:
    """(physical cores or None if cpuinfo cannot tell, sockets)."""
    sockets = {p["physical id"] for p in procs if "physical id" in p}
    n_sockets = max(1, len(sockets))
    if procs and all("physical id" in p and "core id" in p for p in procs):
        # SMT siblings share (physical id, core id); core ids repeat across sockets.
        return len({(p["physical id"], p["core id"]) for p in procs}), n_sockets
    per_socket = _int(procs[0].get("cpu cores")) if procs else None
    if per_socket:
        return min(len(procs), per_socket * n_sockets), n_sockets
    return None, n_sockets


def parse_cpuinfo(text: str, cache_bytes: tuple[tuple[str, int], ...] = (),
                  cache_shared_cpus: tuple[tuple[str, int], ...] = (),
                  topology_cores: int | None = None) -> Platform:
    """Build a Platform from /proc/cpuinfo text (x86 layout).

    ``topology_cores`` (physical cores counted from sysfs) is used only when
    cpuinfo itself carries no core topology (some VMs); without either, every
    logical CPU is counted as a core.
    """
    procs = _split_processors(text)
    first = procs[0] if procs else {}
    vendor = _VENDORS.get(first.get("vendor_id", ""), "unknown")
    flags = frozenset(first.get("flags", "").split())
    family, model, stepping = _int(first.get("cpu family")), _int(first.get("model")), _int(first.get("stepping"))
    logical = max(1, len(procs))
    cores, sockets = _count_cores(procs)
    if cores is None:
        cores = topology_cores or logical
    return Platform(
        vendor=vendor, model_name=first.get("model name", ""), family=family, model=model,
        microarch=microarch_of(vendor, family, model, stepping, flags), flags=flags,
        physical_cores=max(1, cores), logical_cpus=logical, cache_bytes=cache_bytes, sockets=sockets,
        stepping=stepping, cache_shared_cpus=cache_shared_cpus,
    )


# ---- sysfs -------------------------------------------------------------------

_SIZE_SUFFIX = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


def _parse_size(text: str) -> int | None:
    """'32K' -> 32768, '1024K', '32M', '512' (bytes); None for anything else."""
    text = text.strip().upper().removesuffix("B")
    mult = _SIZE_SUFFIX.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in _SIZE_SUFFIX else text
    return int(digits) * mult if digits.isdigit() else None


def _cpu_list_len(text: str) -> int:
    """Number of CPUs in a sysfs list such as '0-7,64-71'."""
    n = 0
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit():
            n += (int(hi) - int(lo) + 1) if hi.isdigit() else 1
    return n


CacheInfo = tuple[tuple[str, int], ...]  # (("L1d", n), ("L2", n), ...)


def read_sysfs_caches(cpu_root: Path = SYSFS_CPU_ROOT) -> tuple[CacheInfo, CacheInfo]:
    """(sizes in bytes, CPUs sharing each) of cpu0's data/unified caches under ``cpu_root``; empty where unreadable."""
    sizes: list[tuple[str, int]] = []
    shared: list[tuple[str, int]] = []
    for idx in sorted((cpu_root / "cpu0" / "cache").glob("index*")):
        try:
            level = (idx / "level").read_text().strip()
            kind = (idx / "type").read_text().strip()
            size = _parse_size((idx / "size").read_text())
        except OSError:
            continue
        if kind == "Instruction" or size is None:
            continue
        name = f"L{level}d" if level == "1" else f"L{level}"
        sizes.append((name, size))
        try:
            shared.append((name, _cpu_list_len((idx / "shared_cpu_list").read_text())))
        except OSError:
            pass
    return tuple(sizes), tuple(shared)


def read_sysfs_cores(cpu_root: Path = SYSFS_CPU_ROOT) -> int | None:
    """Physical cores counted as unique (package, core) pairs in sysfs topology, or None."""
    pairs = set()
    for topo in cpu_root.glob("cpu[0-9]*/topology"):
        try:
            pairs.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            return None
    return len(pairs) or None


def _usable_cpus() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def detect(cpuinfo_path: Path = CPUINFO_PATH, sysfs_root: Path = SYSFS_CPU_ROOT) -> Platform:
    """The CPU this process runs on (paths injectable so tests can feed recorded files)."""
    caches, shared = read_sysfs_caches(sysfs_root)
    try:
        text = cpuinfo_path.read_text()
    except OSError as e:
        log.warning("cannot read %s (%s); assuming a generic CPU without SIMD extensions", cpuinfo_path, e)
        n = os.cpu_count() or 1
        return Platform(logical_cpus=n, physical_cores=n, cache_bytes=caches, cache_shared_cpus=shared,
                        usable_cpus=_usable_cpus())
    # sysfs topology is read only when cpuinfo has none (VMs that omit "core id" and "cpu cores")
    needs_topology = "core id" not in text and "cpu cores" not in text
    plat = parse_cpuinfo(text, caches, shared, topology_cores=read_sysfs_cores(sysfs_root) if needs_topology else None)
    return replace(plat, usable_cpus=_usable_cpus())
