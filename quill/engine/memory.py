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


def _libc_function(name: str):
    try:
        import ctypes
        import ctypes.util
        lib = ctypes.util.find_library("c")
        return None if lib is None else getattr(ctypes.CDLL(lib), name, None)
    except OSError:
        return None


_MALLOC_TRIM = _libc_function("malloc_trim")
_MALLOPT = _libc_function("mallopt")
# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def release_freed_memory() -> None:
    """Hand memory freed by the C allocator back to the OS (glibc ``malloc_trim``; elsewhere a no-op).

    Loading frees many mid-sized temporaries (each layer's unpacked codes and
    repacking buffers); glibc keeps such freed chunks in its heap, where they
    would count as resident and fragment.  Trimming after each layer keeps the
    process at the size of what it holds.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def keep_step_memory() -> bool:
    """Have the C allocator keep freed memory for reuse instead of handing it back (glibc; elsewhere False).

    A step's large intermediates (a 1.2B prompt chunk's [256, 16384] float32 gate/up is 16 MiB)
    are freed when the step ends.  glibc gives such blocks back to the OS (mmap above its
    adaptive threshold, heap trimming above another), so the next step faulted the same memory
    in again: 200-300K page faults per 512-token prompt, a third of a 1.2B W4A8 prefill spent in
    the kernel (Zen 5: 341-371 -> 457-465 tok/s with this).  Here blocks under 32 MiB come from
    the heap, which grows in 64 MiB steps and gives back only past 1 GiB free; loading still returns
    what it frees explicitly (:func:`release_freed_memory`).  Process-wide: the engine calls it
    once a model is loaded.
    """
    if _MALLOPT is None:
        return False
    return all(_MALLOPT(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20)))


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
