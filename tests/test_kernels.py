"""Every registered kernel against the ``reference`` oracle.

Generic over ``KERNELS``: a kernel registered later joins automatically.  A
case a kernel refuses (``supported``/``can_implement``) is recorded with its
reason, which must be a non-empty string, and every kernel must actually run a
meaningful part of the grid on this machine.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quill.bench.stats import sqnr_db
from quill.canonical import E8M0, FP4_E2M1, ActivationQuant, QuantizedWeight
from quill.kernels import LinearLayerConfig, resolve_activation
from quill.kernels.selection import KERNELS, kernel_class
from quill.platform import detect
from quill.writers.rtn import quantize_rtn

PLATFORM = detect()
MIN_SQNR_DB = 40.0
UNDER_TEST = sorted(n for n in KERNELS if n != "reference")  # reference is the oracle
REFERENCE = kernel_class("reference")
M_VALUES = (1, 7, 64)
MIN_CASES = 12  # each kernel must run at least this many grid cases (x every M) on this machine




@dataclass(frozen=True)
class Case:
    bits: int
    group: int  # -1: per-channel
    kind: str  # "sym" | "asym" | "offsets" | "fp4" (MXFP4: FP4 E2M1 codebook codes, E8M0 scales per 32)
    act_order: bool
    n: int
    k: int
    act: str | None  # None (float), "int8" / "int8-group" (what the user asks for), or a W8A8 checkpoint's

    def __str__(self):
        g = "ch" if self.group == -1 else f"g{self.group}"
        return (f"W{self.bits} {g} {self.kind}{' act-order' if self.act_order else ''} {self.n}x{self.k} "
                f"{'A16' if self.act is None else 'A8' if self.act == 'int8' else self.act}")


# Activation quantizations a W8A8 checkpoint may prescribe (inputs are ~N(0, 1): a static range of +-4).
ACTIVATIONS = {
    "int8_asym": ActivationQuant(dynamic=True, symmetric=False),
    "int8_static": ActivationQuant(dynamic=False, symmetric=True, scale=4.0 / 127),
    "int8_static_asym": ActivationQuant(dynamic=False, symmetric=False, scale=8.5 / 255, zero_point=-8),
}


def make_weight(case: Case, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if case.kind == "fp4":
        w = QuantizedWeight(codes=torch.randint(0, 16, (case.n, case.k), dtype=torch.uint8, generator=g), bits=4,
                            group_size=32, codebook=FP4_E2M1.clone(), name=f"test[{case}]",
                            scales=torch.randint(118, 126, (case.n, case.k // 32), dtype=torch.uint8,
                                                 generator=g).view(E8M0))
        return w.with_(activation=resolve_activation(w, case.act))
    w = quantize_rtn(torch.randn(case.n, case.k, generator=g), case.bits, case.group,
                     symmetric=case.kind == "sym", offsets=case.kind == "offsets", act_order=case.act_order,
                     generator=g)
    w = w.with_(name=f"test[{case}]")
    if case.act in ACTIVATIONS:
        return w.with_(activation=ACTIVATIONS[case.act])
    return w.with_(activation=resolve_activation(w, case.act))


def _grid() -> list[Case]:
    cases = []
    # 4 and 8 bits: every group size (K = 384 takes 32, 64, 128, the odd divisor 48, and per-channel),
    # every zero-point kind, with and without act-order, float and int8 activations
    for bits, group, kind, ao, act in itertools.product(
            (4, 8), (32, 64, 128, 48, -1), ("sym", "asym", "offsets"), (False, True), (None, "int8", "int8-group")):
        if not (ao and group == -1):  # act-order is meaningless with one group
            cases.append(Case(bits, group, kind, ao, 40, 384, act))
    # 2/3 bits (run as 4-bit codes) and 5/6 bits (GGUF Q5_0 / Q5_1, the K-quants' Q5_K / Q6_K codes)
    for bits, group, kind, ao, act in itertools.product((2, 3, 5, 6), (32, -1), ("sym", "asym"), (False, True),
                                                        (None, "int8")):
        if not (ao and group == -1):
            cases.append(Case(bits, group, kind, ao, 40, 384, act))
    # the activation quantizations W8A8 checkpoints prescribe besides dynamic symmetric per token
    for bits, group, act in itertools.product((4, 8), (32, -1), ACTIVATIONS):
        cases.append(Case(bits, group, "sym", False, 40, 384, act))
    # W8A8 with per-channel symmetric weights (what W8A8 checkpoints hold) on more shapes
    for (n, k), act in itertools.product(((64, 256), (7, 520), (130, 64), (1, 384)), ("int8",) + tuple(ACTIVATIONS)):
        cases.append(Case(8, -1, "sym", False, n, k, act))
    # MXFP4 (its own native kernels; every other kernel runs its uniform 5-bit form, as selection gives it)
    for (n, k), act in itertools.product(((40, 384), (33, 96), (1, 96), (17, 64), (64, 256), (130, 64), (16, 32),
                                          (48, 128), (7, 160), (80, 96), (3, 224), (25, 64)), (None, "int8-group")):
        cases.append(Case(4, 32, "fp4", False, n, k, act))
    # odd shapes: N not a multiple of 16, a single output, K = 96 and K = 136 (not a multiple of 32)
    for (n, k), bits, group, kind, act in itertools.product(
            ((33, 96), (1, 96), (17, 136)), (4, 8), (8, 32, -1), ("sym", "asym"), (None, "int8")):
        if k % (k if group == -1 else group) == 0 and (bits == 8 or act is None):
            cases.append(Case(bits, group, kind, False, n, k, act))
    return cases


GRID = _grid()


@pytest.fixture(scope="module")
def oracle():
    """Reference outputs per case and M, computed once for all kernels."""
    cache = {}

    def get(case: Case, m: int):
        if case not in cache:
            w = make_weight(case)
            cfg = LinearLayerConfig.from_weight(w, PLATFORM)
            cache[case] = (w, cfg, REFERENCE.prepare(w.uniform(), cfg.as_uniform()), {})
        w, cfg, state, outs = cache[case]
        if m not in outs:
            x = torch.randn(m, case.k, generator=torch.Generator().manual_seed(m))
            outs[m] = (x, REFERENCE.apply(state, x))
        return w, cfg, outs[m]
    return get


def _platform_refusal(name: str) -> None:
    reason = kernel_class(name).supported(PLATFORM)
    if reason is not None:
        assert isinstance(reason, str) and reason.strip()
        pytest.skip(f"kernel '{name}' cannot run on this machine: {reason}")


@pytest.mark.parametrize("name", UNDER_TEST)
def test_kernel_matrix(name, oracle):
    _platform_refusal(name)
    kernel = kernel_class(name)
    ran, refused, failures = defaultdict(int), {}, []
    for case in GRID:
        w, cfg, _ = oracle(case, M_VALUES[0])
        if not kernel.codebook_codes:  # what build_quant_linear hands it
            w, cfg = w.uniform(), cfg.as_uniform()
        reason = kernel.can_implement(cfg)
        if reason is not None:
            assert isinstance(reason, str) and reason.strip(), f"{name} refused {case} without a reason"
            refused[str(case)] = reason
            continue
        state = kernel.prepare(w, cfg)
        refs, ys = [], []
        for m in M_VALUES:
            _, _, (x, ref) = oracle(case, m)
            y = kernel.apply(state, x)
            assert y.shape == ref.shape and y.dtype == ref.dtype
            refs.append(ref.flatten())
            ys.append(y.flatten())
            # SQNR of a handful of numbers measures cancellation in one dot product, not the kernel:
            # tiny outputs (N = 1, M = 1) are judged together with the other M below
            if ref.numel() >= 32 and not sqnr_db(ref, y) >= MIN_SQNR_DB:
                failures.append(f"{case} M={m}: {sqnr_db(ref, y):.1f} dB")
        pooled = sqnr_db(torch.cat(refs), torch.cat(ys))
        if not pooled >= MIN_SQNR_DB:
            failures.append(f"{case} all M: {pooled:.1f} dB")
        ran["bits", case.bits] += 1
        ran["act", case.act] += 1
    assert not failures, f"kernel '{name}' below {MIN_SQNR_DB} dB:\n" + "\n".join(failures)
    total = sum(v for (axis, _), v in ran.items() if axis == "act")
    print(f"\n{name}: ran {total} of {len(GRID)} cases x M={M_VALUES}; refused {len(refused)}: "
          f"{sorted(set(refused.values()))}")
    # a kernel that refuses nearly everything is not "tested" by this matrix
    assert total >= MIN_CASES, f"kernel '{name}' ran only {total} cases; refusals: {refused}"


@pytest.mark.parametrize("name", UNDER_TEST)
def test_kernel_3d_input_bias_and_half_precision(name):
    _platform_refusal(name)
    kernel = kernel_class(name)
    gen = torch.Generator().manual_seed(3)
    checked = 0
    for case in (Case(4, 32, "asym", False, 48, 256, None), Case(8, -1, "sym", False, 48, 256, "int8"),
                 Case(4, 64, "sym", True, 48, 256, None), Case(8, -1, "sym", False, 48, 256, None),
                 Case(4, 32, "sym", False, 48, 256, "int8"),  # W4A8
                 Case(6, 32, "asym", False, 48, 256, None), Case(5, 32, "sym", False, 48, 256, "int8"),
                 Case(3, 32, "asym", False, 48, 256, None), Case(2, 16, "sym", False, 48, 256, "int8"),
                 Case(4, 32, "fp4", False, 48, 256, None), Case(4, 32, "fp4", False, 48, 256, "int8-group")):
        w = make_weight(case)
        cfg = LinearLayerConfig.from_weight(w, PLATFORM)
        if not kernel.codebook_codes:
            w, cfg = w.uniform(), cfg.as_uniform()
        if kernel.can_implement(cfg):
            continue
        state, ref_state = kernel.prepare(w, cfg), REFERENCE.prepare(w, cfg)
        bias = torch.randn(case.n, generator=gen)
        x3 = torch.randn(2, 5, case.k, generator=gen)  # [B, T, K]
        y3 = kernel.apply(state, x3, bias)
        assert y3.shape == (2, 5, case.n)
        assert sqnr_db(REFERENCE.apply(ref_state, x3, bias), y3) >= MIN_SQNR_DB, f"{case} 3-D + bias"
        flat = kernel.apply(state, x3.reshape(10, case.k), bias).reshape(2, 5, case.n)
        assert sqnr_db(flat, y3) >= 80, f"{case}: 3-D and flattened inputs disagree"
        # no rows at all: a chunked prefill's intermediate chunk sends [1, 0, K] to the LM head
        assert kernel.apply(state, x3[:1, :0], bias).shape == (1, 0, case.n), f"{case}: empty input"
        for dtype in (torch.bfloat16, torch.float16):
            xh = x3.to(dtype)
            yh = kernel.apply(state, xh, bias)
            assert yh.dtype == dtype and yh.shape == (2, 5, case.n)
            assert sqnr_db(REFERENCE.apply(ref_state, xh, bias), yh) >= MIN_SQNR_DB, f"{case} {dtype}"
        checked += 1
    assert checked >= 1, f"kernel '{name}' refused every 3-D/bias/half-precision case"


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 70), k_units=st.integers(1, 12), group_units=st.sampled_from([1, 2, 4, -1]),
       bits=st.sampled_from([2, 3, 4, 5, 6, 8]), kind=st.sampled_from(["sym", "asym"]), int8=st.booleans(),
       m=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_random_shapes(n, k_units, group_units, bits, kind, int8, m, seed):
    k = 32 * k_units
    group = -1 if group_units == -1 or k % (32 * group_units) else 32 * group_units
    case = Case(bits, group, kind, False, n, k, "int8" if int8 else None)
    w = make_weight(case, seed)
    cfg = LinearLayerConfig.from_weight(w, PLATFORM)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    ref = REFERENCE.apply(REFERENCE.prepare(w, cfg), x)
    for name in UNDER_TEST:
        kernel = kernel_class(name)
        reason = kernel.supported(PLATFORM) or kernel.can_implement(cfg)
        if reason is not None:
            assert isinstance(reason, str) and reason.strip()
            continue
        assert sqnr_db(ref, kernel.apply(kernel.prepare(w, cfg), x)) >= MIN_SQNR_DB, f"{name} {case} M={m}"


def _unequal_groups_weight(bits: int, act: ActivationQuant | None) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(5)
    k, n = 128, 24
    sizes = torch.tensor([16, 48, 32, 32])  # 4 groups of unequal size
    g_idx = torch.repeat_interleave(torch.arange(4), sizes)[torch.randperm(k, generator=gen)].to(torch.int32)
    return QuantizedWeight(
        codes=torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=gen), bits=bits, group_size=32,
        scales=(torch.rand(n, 4, generator=gen) * 0.1 + 0.01).half(),
        zeros=torch.randint(0, 1 << bits, (n, 4), generator=gen).to(torch.int16), g_idx=g_idx,
        activation=act, name=f"unequal W{bits}").validate()


@pytest.mark.parametrize("name", UNDER_TEST)
def test_act_order_with_unequal_groups(name):
    """A valid g_idx need not give every group the same number of columns."""
    _platform_refusal(name)
    kernel = kernel_class(name)
    refusals = []
    cases = ((4, None), (8, None), (8, ActivationQuant()), (4, ActivationQuant()), (6, None),
             (5, ActivationQuant()))
    for bits, act in cases:
        w = _unequal_groups_weight(bits, act)
        cfg = LinearLayerConfig.from_weight(w, PLATFORM)
        reason = kernel.can_implement(cfg)
        if reason is not None:
            assert reason.strip()
            refusals.append(reason)
            continue
        x = torch.randn(7, w.in_features, generator=torch.Generator().manual_seed(bits))
        ref = REFERENCE.apply(REFERENCE.prepare(w, cfg), x)
        assert sqnr_db(ref, kernel.apply(kernel.prepare(w, cfg), x)) >= MIN_SQNR_DB, f"{name} {cfg.summary()}"
    if len(refusals) == len(cases):
        pytest.skip(f"kernel '{name}' runs no act-order layer: {refusals}")
