"""Kernel benchmark: native kernels beside torch int4pack/int8pack and dense bf16/fp32 matmul.

For every shape (N x K) and token count M it times each kernel with its weights
rotated through copies totalling at least four times the L3 cache (so decode-sized
calls really stream from DRAM), reports the median of several runs as time,
GB/s of weight bytes and GFLOP/s, and compares with the DRAM read bandwidth
measured in the same run.  Weight bytes are the format's own (``storage_bytes``:
packed codes plus scales), the same figure for every kernel of one format.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from quill.bench.memory import Bandwidth
from quill.bench.stats import sqnr
from quill.canonical import ActivationQuant, QuantizedWeight
from quill.kernels.config import LinearLayerConfig
from quill.kernels.selection import kernel_class
from quill.platform import Platform
from quill.writers.rtn import quantize_rtn

SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096))
TOKENS = (1, 8, 32, 128, 512)
# label -> (weight bits, int8 activations, kernel name or dense dtype); activations bf16 unless noted
CASES: dict[str, tuple[int, bool, str]] = {
    "native_w4a16": (4, False, "native_w4a16"),
    "native_w4a8": (4, True, "native_w4a8"),
    "torch_w4": (4, False, "torch"),  # _weight_int4pack_mm_for_cpu
    "native_w8a16": (8, False, "native_w8a16"),
    "native_w8a8": (8, True, "native_w8a8"),
    "torch_w8": (8, False, "torch"),  # _weight_int8pack_mm
    "bf16": (16, False, "dense"),
    "fp32": (32, False, "dense"),
}
MAX_COPIES = 64
ROTATION_L3 = 4  # weights rotate through copies totalling this many L3 caches
W4_GROUP = 128  # GPTQ/AWQ's usual group; 8-bit weights are per-channel (compressed-tensors W8A8)


def w4_group(k: int) -> int:
    """W4_GROUP, or the largest power-of-two group under it that divides K (576: 64, the default model's)."""
    g = W4_GROUP
    while g > 16 and k % g:
        g //= 2
    return g


@dataclass
class Result:
    kernel: str
    n: int
    k: int
    m: int
    time_us: float
    weight_bytes: int
    copies: int

    @property
    def gbs(self) -> float:
        return self.weight_bytes / self.time_us / 1e3

    @property
    def gflops(self) -> float:
        return 2.0 * self.m * self.n * self.k / self.time_us / 1e3

    def to_json(self) -> dict:
        return {**asdict(self), "weight_gbs": round(self.gbs, 2), "gflops": round(self.gflops, 1)}


@dataclass
class Suite:
    platform: Platform
    threads: int
    bandwidth: Bandwidth  # measured at the start of the run
    shape_bandwidth: dict[tuple[int, int], float] = field(default_factory=dict)  # all threads, before each shape
    results: list[Result] = field(default_factory=list)
    accuracy: list[dict] = field(default_factory=list)

    def peak(self) -> tuple[float, str]:
        """The highest all-thread read any probe of this run measured (the native streaming read and
        torch.sum, at the start and before each shape), and which probe it was: the roofline every
        %BW uses (a low probe on a shared host would flatter the kernels)."""
        b = self.bandwidth
        probes = [(b.torch_sum_all, "torch.sum at the start")]
        if b.native_all is not None:
            probes.append((b.native_all, "quill's streaming read at the start"))
        probes += [(v, f"the best probe before shape {n}x{k}") for (n, k), v in self.shape_bandwidth.items()]
        return max(probes, key=lambda t: t[0])

    def bandwidth_for(self, r: Result) -> float:
        """The roofline of ``r``: :meth:`peak`, the same for every result of the run."""
        return self.peak()[0]


def quantized_weight(n: int, k: int, bits: int, seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    qw = quantize_rtn(w, bits, w4_group(k) if bits == 4 else -1, symmetric=True, generator=g)
    qw = qw.with_(name=f"bench.{n}x{k}.w{bits}")
    return qw


def _prepare(case: str, qw: QuantizedWeight | None, dense: torch.Tensor | None, platform: Platform,
             threads: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], int, int]:
    """One prepared copy: (call(x), weight bytes, bytes actually held)."""
    bits, int8, name = CASES[case]
    if name == "dense":
        w = dense.to(torch.bfloat16 if bits == 16 else torch.float32).contiguous()  # [N, K]
        return (lambda x: torch.nn.functional.linear(x, w)), w.numel() * w.element_size(), w.numel() * w.element_size()
    w = qw.with_(activation=ActivationQuant()) if int8 else qw
    cfg = LinearLayerConfig.from_weight(w, platform)
    kernel = kernel_class(name)
    reason = kernel.supported(platform) or kernel.can_implement(cfg)
    if reason:
        raise RuntimeError(f"{case}: {reason}")
    state = kernel.prepare(w, cfg)
    if hasattr(state, "set_threads"):
        state.set_threads(threads)
    return (lambda x: kernel.apply(state, x)), w.storage_bytes(), kernel.state_bytes(state)


@dataclass
class Prepared:
    """One kernel's copies of one layer, and the bytes it is credited with."""

    case: str
    calls: list[Callable[[torch.Tensor], torch.Tensor]]
    weight_bytes: int


def prepare_case(suite: Suite, case: str, n: int, k: int) -> Prepared:
    """Enough copies of the layer to fill ROTATION_L3 x L3 (tiny layers stay cached regardless)."""
    bits = CASES[case][0]
    qw = quantized_weight(n, k, bits) if bits in (4, 8) else None
    dense = quantized_weight(n, k, 4).dequantize() if qw is None else None
    l3 = suite.platform.cache("L3") or (32 << 20)
    first, wbytes, held = _prepare(case, qw, dense, suite.platform, suite.threads)
    n_copies = min(MAX_COPIES, max(2, math.ceil(ROTATION_L3 * l3 / held)))
    rest = [_prepare(case, qw, dense, suite.platform, suite.threads)[0] for _ in range(n_copies - 1)]
    return Prepared(case, [first] + rest, wbytes)


def _one_run(p: Prepared, x: torch.Tensor, calls_per_run: int) -> float:
    """Seconds per call over ``calls_per_run`` calls cycling through the copies."""
    t = time.perf_counter()
    for i in range(calls_per_run):
        p.calls[i % len(p.calls)](x)
    return (time.perf_counter() - t) / calls_per_run


def run_shape(suite: Suite, prepared: list[Prepared], n: int, k: int, tokens: tuple[int, ...], runs: int,
              min_run_s: float, log: Callable[[str], None]) -> None:
    """Time every prepared kernel at every M, the kernels interleaved run by run.

    Interleaving keeps the ratios fair on a shared machine: a slow spell of the
    neighbours hits every kernel's samples alike instead of one kernel's all.
    """
    for m in tokens:
        xs = {dt: torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dt)  # [M, K]
              for dt in (torch.bfloat16, torch.float32)}
        plan = []
        for p in prepared:
            x = xs[torch.float32 if p.case == "fp32" else torch.bfloat16]
            est = max(_one_run(p, x, len(p.calls)), 1e-7)  # also the warm-up
            per_run = len(p.calls) * max(1, math.ceil(min_run_s / (est * len(p.calls))))
            plan.append((p, x, per_run, []))
        for _ in range(runs):
            for p, x, per_run, samples in plan:
                samples.append(_one_run(p, x, per_run))
        for p, _, _, samples in plan:
            r = Result(p.case, n, k, m, statistics.median(samples) * 1e6, p.weight_bytes, len(p.calls))
            suite.results.append(r)
            log(f"  {p.case:<13} {n:>5}x{k:<5} M={m:<4} {r.time_us:10.1f} us {r.gbs:7.1f} GB/s "
                f"{r.gflops:8.1f} GFLOP/s")


def accuracy(n: int, k: int, platform: Platform, m: int = 8) -> dict:
    """SQNR (dB) of W4A8 against W4A16 and of both against the float32 reference, bf16 activations."""
    qw = quantized_weight(n, k, 4)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    ref = x.float() @ qw.dequantize().T  # [M, N]

    def out(case):
        f, _, _ = _prepare(case, qw, None, platform, 1)
        return f(x).float()

    a16, a8 = out("native_w4a16"), out("native_w4a8")
    return {"n": n, "k": k, "m": m, "w4a8_vs_w4a16_db": round(sqnr(a8, a16), 1),
            "w4a16_vs_fp32_db": round(sqnr(a16, ref), 1), "w4a8_vs_fp32_db": round(sqnr(a8, ref), 1)}
