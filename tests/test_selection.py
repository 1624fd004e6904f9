"""Kernel selection: priority order, refusals, forcing, disabling, unknown names."""

import logging

import pytest
import torch

from quill.errors import KernelSelectionError
from quill.kernels import KernelPolicy, KernelSelector, LinearLayerConfig, build_quant_linear
from quill.kernels.selection import KERNELS
from quill.platform import Platform
from quill.quantization.quantize import quantize_rtn

PLAT = Platform(vendor="AMD", microarch="zen3", flags=frozenset({"avx2", "fma", "f16c"}))


def _weight(bits=4, gs=32):
    qw = quantize_rtn(torch.randn(32, 64), bits, gs, generator=torch.Generator().manual_seed(0))
    qw.name = "model.layers.0.mlp.up_proj"
    return qw


def _cfg(qw):
    return LinearLayerConfig.from_weight(qw, PLAT)


def test_policy_from_env():
    p = KernelPolicy.from_env({"QUILL_KERNEL": "reference", "QUILL_DISABLED_KERNELS": "torch, x ,"})
    assert p.force == "reference" and p.disabled == frozenset({"torch", "x"})
    assert KernelPolicy.from_env({}) == KernelPolicy()


def test_unknown_kernel_names_are_errors():
    with pytest.raises(KernelSelectionError, match="unknown kernel name.*nosuch.*known kernels: .*reference, torch"):
        KernelSelector(PLAT, KernelPolicy(force="nosuch"))
    with pytest.raises(KernelSelectionError, match="nosuch"):
        KernelSelector(PLAT, KernelPolicy(disabled=frozenset({"nosuch"})))


def test_force_and_disable():
    qw = _weight()
    sel = KernelSelector(PLAT, KernelPolicy(force="reference")).select(_cfg(qw), qw.name)
    assert sel.name == "reference" and sel.forced
    sel = KernelSelector(PLAT, KernelPolicy(disabled=frozenset({"torch"})), priorities=("torch", "reference"))
    choice = sel.select(_cfg(qw), qw.name)
    assert choice.name == "reference"
    assert choice.refusals == (("torch", "disabled by QUILL_DISABLED_KERNELS"),)
    with pytest.raises(KernelSelectionError, match="both forced"):
        KernelSelector(PLAT, KernelPolicy(force="torch", disabled=frozenset({"torch"})))


def test_no_kernel_lists_every_refusal():
    qw = _weight()
    sel = KernelSelector(PLAT, KernelPolicy(disabled=frozenset(KERNELS)), priorities=("torch", "reference"))
    with pytest.raises(KernelSelectionError) as e:
        sel.select(_cfg(qw), qw.name)
    msg = str(e.value)
    assert "model.layers.0.mlp.up_proj" in msg and "W4A16 g32 sym" in msg
    assert "- torch: disabled" in msg and "- reference: disabled" in msg


def test_choice_logged_once(caplog):
    qw = _weight()
    sel = KernelSelector(PLAT, priorities=("torch", "reference"))
    with caplog.at_level(logging.INFO, logger="quill.kernels"):
        for _ in range(3):
            build_quant_linear(qw, sel)
    assert sum("kernel torch" in r.getMessage() for r in caplog.records) == 1
