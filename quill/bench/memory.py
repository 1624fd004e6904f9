"""The machine's DRAM read bandwidth, measured the way the kernels read weights: streaming, once."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from quill import native


@dataclass(frozen=True)
class Bandwidth:
    """Read bandwidth in GB/s (1e9 bytes/s), median of several passes over a buffer several times L3."""

    buffer_bytes: int
    native_1t: float | None  # quill's streaming-read probe, 1 thread
    native_all: float | None  # the same with all threads
    torch_sum_1t: float  # torch.sum over the buffer, 1 thread
    torch_sum_all: float
    threads: int

    @property
    def best_all(self) -> float:
        """The figure kernels are compared against: the best all-thread read measured."""
        return max(v for v in (self.native_all, self.torch_sum_all) if v is not None)

    @property
    def best_1t(self) -> float:
        return max(v for v in (self.native_1t, self.torch_sum_1t) if v is not None)


def _median_gbs(fn, nbytes: int, runs: int) -> float:
    fn()  # fault the pages in, warm the pool
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def measure(l3_bytes: int, threads: int, runs: int = 5, nbytes: int | None = None) -> Bandwidth:
    """Stream a buffer of 8 x L3 (at least 256 MiB, or ``nbytes``) with 1 and ``threads`` threads."""
    nbytes = nbytes or max(8 * l3_bytes, 256 << 20)
    buf = torch.ones(nbytes // 8, dtype=torch.int64)  # [nbytes / 8], 4 KiB pages (torch's allocator)
    fbuf = buf.view(torch.float64)
    ext = native.load().module
    if ext is not None:  # the probe reads from 2 MiB pages, as the native kernels' weights are
        buf = ext.huge_page_copy(buf)
    saved = torch.get_num_threads()
    out = {}
    try:
        for t in (1, threads):
            torch.set_num_threads(t)
            out[f"sum{t}"] = _median_gbs(lambda: fbuf.sum(), nbytes, runs)
            out[f"nat{t}"] = _median_gbs(lambda: ext.stream_read(buf, t), nbytes, runs) if ext else None
    finally:
        torch.set_num_threads(saved)
    return Bandwidth(nbytes, out["nat1"], out[f"nat{threads}"], out["sum1"], out[f"sum{threads}"], threads)


class Probe:
    """A read-bandwidth probe to call between timed runs: the buffer is allocated once.

    On a shared host the bandwidth moves within seconds, so a run is best compared with
    probes taken just before and after it (:meth:`read_gbs`, all threads, ~0.1 s).
    """

    def __init__(self, l3_bytes: int, threads: int, nbytes: int | None = None):
        self.nbytes = nbytes or max(8 * l3_bytes, 256 << 20)
        self.threads = threads
        buf = torch.ones(self.nbytes // 8, dtype=torch.int64)  # [nbytes / 8]
        self._ext = native.load().module
        self._buf = self._ext.huge_page_copy(buf) if self._ext is not None else buf.view(torch.float64)

    def read_gbs(self, runs: int = 3) -> float:
        """Median all-thread read bandwidth, GB/s (quill's streaming probe, else torch.sum)."""
        saved = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            if self._ext is not None:
                return _median_gbs(lambda: self._ext.stream_read(self._buf, self.threads), self.nbytes, runs)
            return _median_gbs(lambda: self._buf.sum(), self.nbytes, runs)
        finally:
            torch.set_num_threads(saved)
