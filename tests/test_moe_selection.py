"""MoE backend selection: the linear kernels' mechanics with the MoE family's names and variables."""

import logging

import pytest

from quill.errors import KernelSelectionError
from quill.kernels import KernelPolicy
from quill.moe import MOE_BACKENDS, MOE_REGISTRY, MoELayerConfig, MoESelector, build_fused_moe
from tests.moe_util import FORMATS, PLAT, make_experts, selectors

H, I = 64, 32


def _cfg():
    return MoELayerConfig.from_experts(make_experts(4, H, I, FORMATS["w4-sym-g32"]), 2, PLAT)


def test_policy_reads_the_moe_variables_only():
    env = {"QUILL_MOE_BACKEND": "reference", "QUILL_DISABLED_MOE_BACKENDS": "grouped, ",
           "QUILL_KERNEL": "torch"}
    p = MOE_REGISTRY.policy_from_env(env)
    assert p.force == "reference" and p.disabled == frozenset({"grouped"})
    assert KernelPolicy.from_env(env).force == "torch"  # the linear family keeps its own variable


def test_default_priority_picks_grouped():
    choice = MoESelector(PLAT).select(_cfg(), "model.layers.0.mlp")
    assert choice.name == "grouped" and not choice.forced and choice.refusals == ()


def test_unknown_backend_names_are_errors():
    with pytest.raises(KernelSelectionError, match="unknown MoE backend name.*nosuch.*QUILL_MOE_BACKEND.*"
                                                   "known MoE backends: grouped, reference"):
        MoESelector(PLAT, KernelPolicy(force="nosuch"))
    with pytest.raises(KernelSelectionError, match="both forced \\(QUILL_MOE_BACKEND\\)"):
        MoESelector(PLAT, KernelPolicy(force="grouped", disabled=frozenset({"grouped"})))


def test_disable_falls_through_and_force_marks_forced():
    sel = MoESelector(PLAT, KernelPolicy(disabled=frozenset({"grouped"})))
    choice = sel.select(_cfg(), "model.layers.0.mlp")
    assert choice.name == "reference"
    assert choice.refusals == (("grouped", "disabled by QUILL_DISABLED_MOE_BACKENDS"),)
    assert MoESelector(PLAT, KernelPolicy(force="reference")).select(_cfg()).forced


def test_no_backend_lists_every_refusal():
    sel = MoESelector(PLAT, KernelPolicy(disabled=frozenset(MOE_BACKENDS)))
    with pytest.raises(KernelSelectionError) as e:
        sel.select(_cfg(), "model.layers.1.mlp")
    msg = str(e.value)
    assert "model.layers.1.mlp (MoE 4x top2 W4A16 g32 sym 64->32): no MoE backend can run this layer" in msg
    assert "- grouped: disabled by QUILL_DISABLED_MOE_BACKENDS" in msg and "- reference: disabled" in msg


def test_forced_backend_that_refuses_says_why(monkeypatch):
    from quill.moe.grouped import GroupedBackend
    monkeypatch.setattr(GroupedBackend, "can_implement", classmethod(lambda cls, cfg: "needs 16 experts"))
    with pytest.raises(KernelSelectionError, match="'grouped' was forced by QUILL_MOE_BACKEND but cannot run it: "
                                                   "needs 16 experts"):
        MoESelector(PLAT, KernelPolicy(force="grouped")).select(_cfg(), "model.layers.0.mlp")
    assert MoESelector(PLAT).select(_cfg()).refusals == (("grouped", "needs 16 experts"),)


def test_choice_logged_once(caplog):
    moe_sel, lin_sel = selectors()
    experts = make_experts(4, H, I, FORMATS["w4-sym-g32"])
    with caplog.at_level(logging.INFO, logger="quill.moe"):
        for layer in range(3):
            build_fused_moe(f"model.layers.{layer}.mlp", experts, 2, moe_sel, lin_sel)
    msgs = [r.getMessage() for r in caplog.records if r.name == "quill.moe"]
    assert len(msgs) == 1 and msgs[0].startswith("MoE backend grouped for MoE 4x top2")
    assert "model.layers.0.mlp" in msgs[0]
