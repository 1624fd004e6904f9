"""Resident and peak memory of this process, for load-time accounting (Linux /proc, else getrusage)."""

from __future__ import annotations

import re
import resource
from dataclasses import dataclass
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        m = re.search(rf"^{field}:\s+(\d+)\s+kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    return 0 if kib is None else kib * 1024


def peak_bytes() -> int:
    """VmHWM (high-water mark of RSS), else getrusage's ru_maxrss (KiB on Linux)."""
    kib = _status_kib("VmHWM")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs); False where that is not possible."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class LoadMemory:
    """Memory measured around a model load, in bytes."""

    baseline_rss: int  # before loading
    resident: int  # RSS growth from loading (the model as it sits in memory)
    peak: int  # peak RSS growth during loading
    largest_layer: int  # float32 bytes of the largest decoder layer: the allowance for one layer in flight
    peak_reset: bool  # False: the peak may include memory used before the load began

    @property
    def bound(self) -> int:
        """What loading may take at its peak: 1.3x the resident model plus one layer."""
        return int(1.3 * self.resident) + self.largest_layer

    @property
    def within_bound(self) -> bool:
        return self.peak <= self.bound


class MemoryMeter:
    """Measure RSS and its peak across a block of work."""

    def __init__(self):
        release_freed_memory()  # so the baseline is what the process holds, not what it once held
        self.peak_reset = reset_peak()
        self.baseline = rss_bytes()

    def finish(self, largest_layer: int) -> LoadMemory:
        rss, peak = rss_bytes(), peak_bytes()
        return LoadMemory(self.baseline, max(0, rss - self.baseline), max(0, peak - self.baseline),
                          largest_layer, self.peak_reset)


def _load_malloc_trim():
    try:
        import ctypes
        import ctypes.util
        name = ctypes.util.find_library("c")
        return None if name is None else getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


_MALLOC_TRIM = _load_malloc_trim()


def release_freed_memory() -> None:
    """Hand memory freed by the C allocator back to the OS (glibc ``malloc_trim``; elsewhere a no-op).

    Loading frees many mid-sized temporaries (each layer's unpacked codes and
    repacking buffers); glibc keeps such freed chunks in its heap, where they
    would count as resident and fragment.  Trimming after each layer keeps the
    process at the size of what it holds.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def available_ram() -> int:
    """Bytes of RAM available to new allocations (MemAvailable), or 4 GiB when it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
