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


def _median_gbs(fn, nbytes: int, runs: int) -> float:
    fn()  # fault the pages in, warm the pool
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


class Probe:
    """Read-bandwidth probes over one buffer of 8 x L3 (at least 256 MiB, or ``nbytes``), allocated once.

    On a shared host the bandwidth moves within seconds, so a timed run is best compared
    with probes taken just before and after it (:meth:`read_gbs`, all threads, ~0.1 s).
    """

    def __init__(self, l3_bytes: int, threads: int, nbytes: int | None = None):
        self.nbytes = nbytes or max(8 * l3_bytes, 256 << 20)
        self.threads = threads
        self._ext = native.load().module
        plain = torch.ones(self.nbytes // 8, dtype=torch.int64)  # [nbytes / 8], 4 KiB pages (torch's allocator)
        self._sum_buf = plain.view(torch.float64)
        # quill's streaming probe reads 2 MiB pages, as the native kernels' weights are
        self._stream_buf = self._ext.huge_page_copy(plain) if self._ext is not None else None

    def _timed(self, fn, threads: int, runs: int, units: float | None = None) -> float:
        """``units`` (default: the buffer's bytes) per second of ``fn`` / 1e9, median of ``runs`` at ``threads``."""
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return _median_gbs(fn, units or self.nbytes, runs)
        finally:
            torch.set_num_threads(saved)

    def compute_gflops(self, threads: int | None = None, runs: int = 3) -> float:
        """float32 GFLOP/s of a 256 x 256 x 256 matmul repeated in cache, on ``threads`` (default: the probe's).
        On a shared host a neighbour's vector work on the same physical cores can take a third of their throughput
        for minutes at an unchanged clock: a round's timings are read beside this figure and the DRAM probe."""
        a = torch.ones(256, 256)
        reps = 16

        def fn():
            for _ in range(reps):
                torch.mm(a, a)

        return self._timed(fn, threads or self.threads, runs, units=2 * 256**3 * reps)

    def sum_gbs(self, threads: int, runs: int = 3) -> float:
        """``torch.sum`` over the buffer, GB/s."""
        return self._timed(lambda: self._sum_buf.sum(), threads, runs)

    def stream_gbs(self, threads: int, runs: int = 3) -> float | None:
        """quill's streaming read, GB/s; None without the native extension."""
        if self._stream_buf is None:
            return None
        return self._timed(lambda: self._ext.stream_read(self._stream_buf, threads), threads, runs)

    def best_gbs(self, runs: int = 3) -> float:
        """The higher of the two all-thread probes (streaming read, ``torch.sum``), GB/s."""
        return max(v for v in (self.stream_gbs(self.threads, runs), self.sum_gbs(self.threads, runs)) if v is not None)

    def read_gbs(self, runs: int = 3) -> float:
        """Median all-thread read bandwidth, GB/s (the streaming probe, else torch.sum)."""
        gbs = self.stream_gbs(self.threads, runs)
        return gbs if gbs is not None else self.sum_gbs(self.threads, runs)


def measure(l3_bytes: int, threads: int, runs: int = 5, nbytes: int | None = None) -> Bandwidth:
    """Stream a buffer of 8 x L3 (at least 256 MiB, or ``nbytes``) with 1 and ``threads`` threads."""
    p = Probe(l3_bytes, threads, nbytes)
    return Bandwidth(p.nbytes, p.stream_gbs(1, runs), p.stream_gbs(threads, runs), p.sum_gbs(1, runs),
                     p.sum_gbs(threads, runs), threads)
