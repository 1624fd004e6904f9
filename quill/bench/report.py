"""Tables, JSON and an optional PNG plot for the kernel benchmark."""

from __future__ import annotations

import json
import platform as pyplatform
import time
from pathlib import Path

import torch

from quill.bench.kernels import Result, Suite
from quill.errors import ConfigError

# which torch kernel a native kernel is compared with (same weight format)
TORCH_BASELINE = {"native_w4a16": "torch_w4", "native_w4a8": "torch_w4",
                  "native_w8a16": "torch_w8", "native_w8a8": "torch_w8"}


def _index(results: list[Result]) -> dict[tuple[str, int, int, int], Result]:
    return {(r.kernel, r.n, r.k, r.m): r for r in results}


def ratios(r: Result, idx: dict) -> dict[str, float | None]:
    """Speed-ups of ``r`` over its torch baseline and dense bf16/fp32 matmul (baseline time / time)."""
    out = {}
    for label, base in (("torch", TORCH_BASELINE.get(r.kernel)), ("bf16", "bf16"), ("fp32", "fp32")):
        b = idx.get((base, r.n, r.k, r.m)) if base else None
        out[label] = None if b is None or b.kernel == r.kernel else b.time_us / r.time_us
    return out


def _fmt(v: float | None, spec: str) -> str:
    width = int(spec.split(".")[0] or 0)
    return "-".rjust(width) if v is None else format(v, spec)


def bandwidth_lines(s: Suite) -> list[str]:
    b = s.bandwidth
    nat = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
    return [
        f"DRAM read bandwidth ({b.buffer_bytes >> 20} MiB buffer, median): "
        f"1 thread {nat(b.native_1t)} GB/s (probe) / {b.torch_sum_1t:.1f} (torch.sum); "
        f"{b.threads} threads {nat(b.native_all)} GB/s (probe) / {b.torch_sum_all:.1f} (torch.sum)",
        "%BW below: against the highest all-thread read of any probe in this run: "
        f"{s.peak()[0]:.1f} GB/s ({s.peak()[1]})",
    ]


def table(s: Suite) -> str:
    idx = _index(s.results)
    lines = bandwidth_lines(s)
    shapes = sorted({(r.n, r.k) for r in s.results}, key=lambda t: (t[0] * t[1], t))
    head = (f"{'M':>4}  {'kernel':<13} {'time us':>10} {'GB/s':>7} {'%BW':>5} {'GFLOP/s':>8} "
            f"{'x torch':>7} {'x bf16':>7} {'x fp32':>7}")
    for n, k in shapes:
        bw = s.peak()[0]
        just_before = s.shape_bandwidth.get((n, k), s.bandwidth.best_all)
        lines += ["", f"N x K = {n} x {k}   (DRAM read just before: {just_before:.1f} GB/s)", head]
        rows = sorted((r for r in s.results if (r.n, r.k) == (n, k)), key=lambda r: (r.m, list(idx).index(
            (r.kernel, r.n, r.k, r.m))))
        for r in rows:
            q = ratios(r, idx)
            lines.append(f"{r.m:>4}  {r.kernel:<13} {r.time_us:>10.1f} {r.gbs:>7.1f} {100 * r.gbs / bw:>5.0f} "
                         f"{r.gflops:>8.1f} {_fmt(q['torch'], '7.2f')} {_fmt(q['bf16'], '7.2f')} "
                         f"{_fmt(q['fp32'], '7.2f')}")
    if s.accuracy:
        lines += ["", "accuracy (SQNR dB, bf16 activations, M=8): W4A8 vs W4A16 | W4A16 vs fp32 ref | W4A8 vs fp32 ref"]
        for a in s.accuracy:
            lines.append(f"  {a['n']} x {a['k']}: {a['w4a8_vs_w4a16_db']} | {a['w4a16_vs_fp32_db']} | "
                         f"{a['w4a8_vs_fp32_db']}")
    return "\n".join(lines)


def to_json(s: Suite, command: str) -> dict:
    idx = _index(s.results)
    return {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": {"model": s.platform.model_name, "microarch": s.platform.microarch, "isa_level": s.platform.isa_level,
                "physical_cores": s.platform.physical_cores, "caches": dict(s.platform.cache_bytes)},
        "threads": s.threads,
        "torch": torch.__version__,
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": pyplatform.python_version(),
        "bandwidth_gbs": {"native_1t": s.bandwidth.native_1t, "native_all": s.bandwidth.native_all,
                          "torch_sum_1t": s.bandwidth.torch_sum_1t, "torch_sum_all": s.bandwidth.torch_sum_all,
                          "reference": s.peak()[0], "reference_probe": s.peak()[1],
                          "buffer_bytes": s.bandwidth.buffer_bytes},
        "shape_bandwidth_gbs": {f"{n}x{k}": round(v, 2) for (n, k), v in s.shape_bandwidth.items()},
        "results": [{**r.to_json(), "bw_fraction": round(r.gbs / s.bandwidth_for(r), 3),
                     "speedup": {k: (None if v is None else round(v, 3)) for k, v in ratios(r, idx).items()}}
                    for r in s.results],
        "accuracy": s.accuracy,
    }


def require_matplotlib() -> None:
    """Raise ConfigError unless matplotlib (an optional dependency: quill[bench]) imports."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'quill[bench]' (or matplotlib)") from None


def plot(s: Suite, path: Path) -> None:
    """GB/s of weight bytes against M, one panel per shape (needs matplotlib)."""
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = sorted({(r.n, r.k) for r in s.results})
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 4), squeeze=False)
    for ax, (n, k) in zip(axes[0], shapes):
        for kernel in dict.fromkeys(r.kernel for r in s.results):
            pts = sorted((r.m, r.gbs) for r in s.results if (r.kernel, r.n, r.k) == (kernel, n, k))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=kernel)
        ax.axhline(s.peak()[0], color="k", linestyle="--", linewidth=1, label="DRAM read (highest probe)")
        ax.set(xscale="log", yscale="log", title=f"{n} x {k}", xlabel="M (tokens)", ylabel="weight GB/s")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_json(s: Suite, path: Path, command: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(s, command), indent=1))
