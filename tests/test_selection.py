"""Kernel selection: priority order, refusals, forcing, disabling, unknown names."""

import logging
from pathlib import Path

import pytest
import torch

from quill.errors import KernelSelectionError, format_choices
from quill.kernels import KernelPolicy, KernelSelector, LinearLayerConfig, build_quant_linear
from quill.kernels.selection import KERNELS, PRIORITIES, kernel_class
from quill.platform import Platform, parse_cpuinfo
from quill.writers.rtn import quantize_rtn

PLAT = Platform(vendor="AMD", microarch="zen3", flags=frozenset({"avx2", "fma", "f16c"}))


def _weight(bits=4, gs=32):
    qw = quantize_rtn(torch.randn(32, 64), bits, gs, generator=torch.Generator().manual_seed(0))
    qw = qw.with_(name="model.layers.0.mlp.up_proj")
    return qw


def _cfg(qw):
    return LinearLayerConfig.from_weight(qw, PLAT)


def test_policy_from_env():
    p = KernelPolicy.from_env({"QUILL_KERNEL": "reference", "QUILL_DISABLED_KERNELS": "torch, x ,"})
    assert p.force == "reference" and p.disabled == frozenset({"torch", "x"})
    assert KernelPolicy.from_env({}) == KernelPolicy()


def test_unknown_kernel_names_are_errors():
    known = format_choices(KERNELS)
    with pytest.raises(KernelSelectionError, match=f"unknown kernel name.*nosuch.*known kernels: {known}"):
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


# ---- refusals ------------------------------------------------------------------

ZEN3 = parse_cpuinfo((Path(__file__).parent / "data" / "cpuinfo" / "zen3_epyc7763_1s8c16t.txt").read_text())

_FAKE_KERNEL = '''
from quill.kernels.reference import ReferenceKernel

class EightBitOnly(ReferenceKernel):
    """A test kernel that refuses every layer that is not 8-bit."""
    name = "eightbit"

    @classmethod
    def can_implement(cls, cfg):
        return None if cfg.bits == 8 else f"eightbit runs 8-bit layers only, found {cfg.bits}-bit"
'''


@pytest.fixture
def eightbit(tmp_path, monkeypatch):
    """Register a refusing kernel the way a real one is registered: a module path in KERNELS."""
    (tmp_path / "quill_test_eightbit.py").write_text(_FAKE_KERNEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(KERNELS, "eightbit", "quill_test_eightbit:EightBitOnly")
    return "eightbit"


def test_refusals_are_recorded_in_priority_order(eightbit):
    qw = _weight(bits=4)  # zentorch refuses the platform, eightbit the layer
    sel = KernelSelector(ZEN3, priorities=("zentorch", eightbit, "torch", "reference")).select(
        LinearLayerConfig.from_weight(qw, ZEN3), qw.name)
    assert sel.name == "torch" and not sel.forced
    names = [n for n, _ in sel.refusals]
    assert names == ["zentorch", "eightbit"]
    reasons = dict(sel.refusals)
    assert reasons["eightbit"] == "eightbit runs 8-bit layers only, found 4-bit"
    assert reasons["zentorch"].startswith("zentorch needs AVX-512") and "avx512_vnni" in reasons["zentorch"]
    assert all(isinstance(r, str) and r.strip() for r in reasons.values())


def test_forcing_a_refusing_kernel_names_kernel_layer_and_reason(eightbit):
    qw = _weight(bits=4)
    with pytest.raises(KernelSelectionError) as e:
        KernelSelector(ZEN3, KernelPolicy(force=eightbit)).select(LinearLayerConfig.from_weight(qw, ZEN3), qw.name)
    msg = str(e.value)
    assert msg == ("model.layers.0.mlp.up_proj (W4A16 g32 sym 32x64): kernel 'eightbit' was forced by QUILL_KERNEL "
                   "but cannot run it: eightbit runs 8-bit layers only, found 4-bit")


def test_forcing_a_kernel_the_platform_refuses():
    qw = _weight(bits=4)
    with pytest.raises(KernelSelectionError, match=r"kernel 'zentorch' was forced by QUILL_KERNEL but cannot run "
                                                   r"it: zentorch needs AVX-512 .* this zen3 CPU lacks avx512f"):
        build_quant_linear(qw, KernelSelector(ZEN3, KernelPolicy.from_env({"QUILL_KERNEL": "zentorch"})))


def test_forcing_a_kernel_outside_the_priority_list(eightbit):
    qw = _weight(bits=8)
    layer = build_quant_linear(qw, KernelSelector(ZEN3, KernelPolicy(force=eightbit), priorities=("torch",)))
    assert layer.kernel_name == "eightbit" and layer.selection.forced and layer.selection.refusals == ()


def test_disabling_falls_through_and_says_so(eightbit):
    qw = _weight(bits=8)
    policy = KernelPolicy.from_env({"QUILL_DISABLED_KERNELS": f"{eightbit},zentorch"})
    sel = KernelSelector(ZEN3, policy, priorities=("zentorch", eightbit, "torch")).select(
        LinearLayerConfig.from_weight(qw, ZEN3), qw.name)
    assert sel.name == "torch"
    assert sel.refusals == (("zentorch", "disabled by QUILL_DISABLED_KERNELS"),
                            ("eightbit", "disabled by QUILL_DISABLED_KERNELS"))


def test_error_lists_every_refusal(eightbit):
    qw = _weight(bits=4)
    policy = KernelPolicy(disabled=frozenset({"torch"}))
    with pytest.raises(KernelSelectionError) as e:
        KernelSelector(ZEN3, policy, priorities=("zentorch", eightbit, "torch")).select(
            LinearLayerConfig.from_weight(qw, ZEN3), qw.name)
    lines = str(e.value).splitlines()
    assert lines[0] == "model.layers.0.mlp.up_proj (W4A16 g32 sym 32x64): no kernel can run this layer:"
    assert lines[1].startswith("  - zentorch: zentorch needs AVX-512")
    assert lines[2] == "  - eightbit: eightbit runs 8-bit layers only, found 4-bit"
    assert lines[3] == "  - torch: disabled by QUILL_DISABLED_KERNELS"
    assert len(lines) == 4


def test_unknown_names_everywhere():
    with pytest.raises(KernelSelectionError, match="unknown kernel 'nosuch'; known kernels: "):
        KernelSelector(PLAT, priorities=("torch", "nosuch"))
    with pytest.raises(KernelSelectionError, match="unknown kernel 'nosuch'"):
        kernel_class("nosuch")
    with pytest.raises(KernelSelectionError, match=r"unknown kernel name\(s\) a, b in QUILL_KERNEL/QUILL_DISABLED"):
        KernelSelector(PLAT, KernelPolicy.from_env({"QUILL_KERNEL": "a", "QUILL_DISABLED_KERNELS": "b"}))


def test_a_kernel_forced_by_option_is_named_as_such(eightbit):
    # LLM(kernel=...) / --kernel: the errors name the option, not an environment variable the user never set
    from quill.layers.context import LoadContext
    with pytest.raises(KernelSelectionError, match=r"unknown kernel name\(s\) nope in the kernel option; known"):
        LoadContext.create(ZEN3, torch.float32, kernel="nope", env={})
    ctx = LoadContext.create(ZEN3, torch.float32, kernel=eightbit, env={"QUILL_DISABLED_KERNELS": "zentorch"})
    qw = _weight(bits=4)
    with pytest.raises(KernelSelectionError, match=r"'eightbit' was forced by the kernel option but cannot run it"):
        ctx.selector.select(LinearLayerConfig.from_weight(qw, ZEN3), qw.name)
    with pytest.raises(KernelSelectionError, match=r"unknown kernel name\(s\) nope in QUILL_KERNEL/QUILL_DISABLED"):
        LoadContext.create(ZEN3, torch.float32, kernel="torch", env={"QUILL_DISABLED_KERNELS": "nope"})


def test_every_priority_list_names_registered_kernels_and_ends_with_reference():
    for level, names in PRIORITIES.items():
        assert set(names) <= set(KERNELS), level
        assert names[-1] == "reference", f"{level}: the oracle must be the last resort"
        assert names.index("zentorch") < names.index("torch"), level


def test_skipped_kernels_are_logged_with_reasons(caplog):
    qw = _weight(bits=4)
    with caplog.at_level(logging.INFO, logger="quill.kernels"):  # the list after the native kernels
        build_quant_linear(qw, KernelSelector(ZEN3, priorities=("zentorch", "torch", "reference")))
    msg = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("kernel torch"))
    assert "W4A16 g32 sym" in msg and "[skipped zentorch: zentorch needs AVX-512" in msg


def test_the_runs_thread_count_reaches_native_kernels_explicitly():
    from quill import native
    from quill.platform import detect
    here = detect()
    if native.load().module is None or native.isa_for(here) is None:
        pytest.skip("no native kernels on this machine")  # the CI machines have them
    for threads in (1, 3):
        lin = build_quant_linear(_weight(), KernelSelector(here, threads=threads))
        assert lin.kernel_name.startswith("native") and lin.config.threads == threads
        assert lin.state.handle.threads == threads
    default = build_quant_linear(_weight(), KernelSelector(here))
    assert default.state.handle.threads == here.default_threads
    with pytest.raises(KernelSelectionError, match="threads must be a positive integer, found 0"):
        KernelSelector(here, threads=0)
