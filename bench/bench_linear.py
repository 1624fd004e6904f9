"""Time every available linear kernel on one layer shape: ``python bench/bench_linear.py [--n 4096 --k 4096]``.

For each weight/activation configuration and batch size M, prints milliseconds
per call (median of ``--reps``) for every kernel that accepts the layer, the
first-call time (which includes any lazy reorder a library does), and the
SQNR against ``reference``.  Timings on a shared machine are noisy: compare
kernels within one run, not across runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quill.kernels import LinearLayerConfig, resolve_activation
from quill.kernels.selection import KERNELS, kernel_class
from quill.platform import detect
from quill.writers.rtn import quantize_rtn

CONFIGS = (  # (label, bits, group size, symmetric, activation)
    ("W4A16 g128 sym", 4, 128, True, None),
    ("W4A16 g128 asym", 4, 128, False, None),
    ("W8A8 ch sym, dynamic int8", 8, -1, True, "int8"),
)


def sqnr_db(ref: torch.Tensor, y: torch.Tensor) -> float:
    ref, y = ref.double(), y.double()
    noise = (ref - y).pow(2).sum()
    return float("inf") if noise == 0 else float(10 * torch.log10(ref.pow(2).sum() / noise))


def time_ms(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    plat = detect()
    print(f"{plat.summary()}; torch threads {torch.get_num_threads()}; layer {args.n}x{args.k}")
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(args.n, args.k, generator=gen) * 0.02
    for label, bits, group, sym, act in CONFIGS:
        w = quantize_rtn(dense, bits, group, symmetric=sym, generator=gen)
        w = w.with_(activation=resolve_activation(w, act))
        cfg = LinearLayerConfig.from_weight(w, plat)
        ref_kernel = kernel_class("reference")
        ref_state = ref_kernel.prepare(w, cfg)
        print(f"\n{label}")
        for name in KERNELS:
            kernel = kernel_class(name)
            reason = kernel.supported(plat) or kernel.can_implement(cfg)
            if reason:
                print(f"  {name:<10} refused: {reason}")
                continue
            t = time.perf_counter()
            state = kernel.prepare(w, cfg)
            prep = (time.perf_counter() - t) * 1e3
            cells = []
            for m in args.m:
                x = torch.randn(m, args.k, generator=gen).to(torch.bfloat16)
                t = time.perf_counter()
                y = kernel.apply(state, x)
                first = (time.perf_counter() - t) * 1e3
                ms = time_ms(lambda: kernel.apply(state, x), args.reps)
                db = sqnr_db(ref_kernel.apply(ref_state, x), y)
                cells.append(f"M={m}: {ms:7.2f} ms (first {first:6.1f}, {db:5.1f} dB)")
            print(f"  {name:<10} prepare {prep:7.1f} ms | " + " | ".join(cells))


if __name__ == "__main__":
    main()
