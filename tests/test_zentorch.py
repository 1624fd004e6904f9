"""The zentorch kernel: when it refuses and why, that it stays quiet, and the hazards it guards against.

Its arithmetic is covered by the generic matrix in test_kernels.py; these tests
cover what is specific to wrapping AMD's library.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quill.bench.stats import sqnr_db
from quill.canonical import ActivationQuant
from quill.kernels import KernelPolicy, KernelSelector, LinearLayerConfig, build_quant_linear, zentorch_ops
from quill.kernels.reference import ReferenceKernel
from quill.kernels.zentorch_ops import REQUIRED_FLAGS, ZentorchKernel, ZentorchWoqKernel, load_zentorch
from quill.platform import Platform, detect, parse_cpuinfo
from quill.writers.rtn import quantize_rtn

DATA = Path(__file__).parent / "data" / "cpuinfo"
ZEN3 = parse_cpuinfo((DATA / "zen3_epyc7763_1s8c16t.txt").read_text())
ZEN4 = parse_cpuinfo((DATA / "zen4_epyc9654_2s4c16t.txt").read_text())
SPR = parse_cpuinfo((DATA / "spr_xeon8480_2s4c16t.txt").read_text())
HOST = detect()
# The native kernels rank ahead of zentorch (faster at decode, docs/lab/BENCHMARKS-notebook.md); these tests
# check zentorch's place among the rest, so they run with the native kernels disabled.
NO_NATIVE = KernelPolicy(disabled=frozenset({"native_w4a16", "native_w4a8", "native_w8a8", "native_w8a16"}))
INSTALLED = importlib.util.find_spec("zentorch") is not None
HOST_QUALIFIES = HOST.is_zen and HOST.has(*REQUIRED_FLAGS)
needs_zentorch = pytest.mark.skipif(not (INSTALLED and HOST_QUALIFIES),
                                    reason="zentorch not installed or this CPU is not an AMD Zen with AVX-512")




KERNELS = (ZentorchKernel, ZentorchWoqKernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_refuses_zen3_without_avx512(kernel):
    reason = kernel.supported(ZEN3)
    assert reason.startswith("zentorch needs AVX-512")
    assert "this zen3 CPU lacks avx512f, avx512bw, avx512vl, avx512dq, avx512_vnni, avx512_bf16" in reason


@pytest.mark.parametrize("kernel", KERNELS)
def test_refuses_zen4_vm_with_avx512_vnni_masked(kernel):
    masked = Platform(vendor="AMD", microarch="zen4", flags=ZEN4.flags - {"avx512_vnni"})
    assert kernel.supported(masked).endswith("this zen4 CPU lacks avx512_vnni")


@pytest.mark.parametrize("kernel", KERNELS)
def test_refuses_intel(kernel):
    assert kernel.supported(SPR) == "zentorch runs on AMD Zen CPUs only; this is Intel sapphire_rapids"


def test_zen3_selection_falls_through_with_reason():
    w = quantize_rtn(torch.randn(32, 64), 8, -1)
    w = w.with_(name="model.layers.0.mlp.down_proj")
    layer = build_quant_linear(w, KernelSelector(ZEN3, NO_NATIVE), activation="int8")
    assert layer.kernel_name == "torch"
    assert dict(layer.selection.refusals)["zentorch"].startswith("zentorch needs AVX-512")


def test_not_installed_reason(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    module, reason = load_zentorch.__wrapped__()
    assert module is None and reason == "zentorch is not installed (pip install 'quill[zen]')"


@needs_zentorch
def test_missing_op_reason(monkeypatch):
    monkeypatch.setattr(zentorch_ops, "REQUIRED_OPS", zentorch_ops.REQUIRED_OPS + ("zentorch_no_such_op",))
    module, reason = load_zentorch.__wrapped__()
    assert module is None
    assert reason.startswith("zentorch 2.")
    assert reason.endswith("does not register torch.ops.zentorch.zentorch_no_such_op")


@needs_zentorch
@pytest.mark.parametrize("kernel", KERNELS)
def test_available_on_this_zen_host(kernel):
    assert kernel.supported(HOST) is None
    assert kernel.supported(ZEN4) is None  # a recorded Zen 4 on a Zen 4 host


@pytest.mark.parametrize("kernel,bits,group,act,reason", [
    (ZentorchKernel, 4, 32, None, "zentorch runs W8A8 layers (int8 weights and activations); this layer has 4-bit "
                                  "weights (4-bit weight-only layers: kernel 'zentorch_woq')"),
    (ZentorchKernel, 8, -1, None, "zentorch has no weight-only int8 op (W8A16); its int8 GEMM needs int8 activations"),
    (ZentorchKernel, 8, 32, "int8", "zentorch_qlinear takes one weight scale per output channel; "
                                    "this layer has groups of 32"),
    (ZentorchWoqKernel, 2, 32, None, "zentorch_woq runs 4-bit weight-only layers; this layer has 2-bit weights"),
    (ZentorchWoqKernel, 8, -1, "int8", "zentorch_woq runs 4-bit weight-only layers; this layer has 8-bit weights"),
    (ZentorchWoqKernel, 4, 32, "int8", "zentorch has no W4A8 op (4-bit weights with int8 activations)"),
])
def test_layer_refusals(kernel, bits, group, act, reason):
    w = quantize_rtn(torch.randn(16, 64), bits, group)
    if act:
        w = w.with_(activation=ActivationQuant())
    assert kernel.can_implement(LinearLayerConfig.from_weight(w, ZEN4)) == reason


def test_asymmetric_int8_weights_refused():
    w = quantize_rtn(torch.randn(16, 64), 8, -1, symmetric=False).with_(activation=ActivationQuant())
    assert ZentorchKernel.can_implement(LinearLayerConfig.from_weight(w, ZEN4)) == (
        "zentorch_qlinear takes symmetric int8 weights; this layer has zero points or offsets")


def test_k_not_multiple_of_8_refused():
    w = quantize_rtn(torch.randn(16, 36), 4, -1)
    assert ZentorchWoqKernel.can_implement(LinearLayerConfig.from_weight(w, ZEN4)) == (
        "zentorch_woq_repack_weight needs in_features divisible by 8, found 36")


_QUIET_SCRIPT = """
import torch
from quill.kernels.zentorch_ops import ZentorchKernel, ZentorchWoqKernel
from quill.kernels import LinearLayerConfig
from quill.platform import detect
from quill.writers.rtn import quantize_rtn
from quill.canonical import ActivationQuant
plat = detect()
assert ZentorchKernel.supported(plat) is None
for kernel, bits, act in ((ZentorchWoqKernel, 4, None), (ZentorchKernel, 8, ActivationQuant(symmetric=False))):
    w = quantize_rtn(torch.randn(64, 256), bits, -1 if bits == 8 else 32).with_(activation=act)
    cfg = LinearLayerConfig.from_weight(w, plat)
    kernel.apply(kernel.prepare(w, cfg), torch.randn(5, 256))
# an op called outside its limits raises, and zendnnl's logger stays silent
try:
    torch.ops.zentorch.zentorch_woq_linear(torch.randn(3, 256), torch.zeros(32, 64, dtype=torch.int32),
                                           torch.ones(8, 64), None, None)
except RuntimeError:
    pass
else:
    raise SystemExit("expected a RuntimeError")
"""


@needs_zentorch
def test_zentorch_prints_nothing():
    """Importing zentorch and running both paths (first calls included) writes nothing to stdout or stderr."""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("ZENDNNL_")}
    res = subprocess.run([sys.executable, "-c", _QUIET_SCRIPT], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).parent.parent, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "" and res.stderr == ""


@needs_zentorch
def test_freed_weights_do_not_poison_new_layers():
    """zendnnl caches reordered weights by address: layers created where freed ones lived must stay correct."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 384, generator=gen)
    for i in range(10):  # same shape every time, so a freed buffer's address is likely reused
        w = quantize_rtn(torch.randn(64, 384, generator=gen), 4, 96, generator=gen)
        cfg = LinearLayerConfig.from_weight(w, HOST)
        ref = ReferenceKernel.apply(ReferenceKernel.prepare(w, cfg), x)
        y = ZentorchWoqKernel.apply(ZentorchWoqKernel.prepare(w, cfg), x)
        assert sqnr_db(ref, y) >= 40, f"layer {i}: stale zendnnl cache entry"
        del w, cfg, y


@needs_zentorch
def test_int8_weight_buffer_is_not_reordered_in_place():
    """zendnnl may reorder int8 weights in the caller's buffer (weight cache mode 2); quill's must stay intact."""
    w = quantize_rtn(torch.randn(48, 256), 8, -1).with_(activation=ActivationQuant())
    cfg = LinearLayerConfig.from_weight(w, HOST)
    state = ZentorchKernel.prepare(w, cfg)
    for m in (1, 16):
        ZentorchKernel.apply(state, torch.randn(m, 256))
    assert torch.equal(state.weight, (w.codes.to(torch.int16) - 128).to(torch.int8))


@needs_zentorch
def test_default_and_forced_choices_on_this_host():
    w4 = quantize_rtn(torch.randn(32, 64), 4, 32)
    w8 = quantize_rtn(torch.randn(32, 64), 8, -1)
    sel = KernelSelector(HOST, NO_NATIVE)
    assert build_quant_linear(w8, sel, activation="int8").kernel_name == "zentorch"
    w8_float = build_quant_linear(w8, sel)  # W8A16: zentorch refuses, torch runs it
    assert w8_float.kernel_name == "torch"
    assert "no weight-only int8 op" in dict(w8_float.selection.refusals)["zentorch"]
    assert build_quant_linear(w4, sel).kernel_name == "torch"  # zentorch_woq is in no priority list
    forced = build_quant_linear(w4, KernelSelector(HOST, KernelPolicy(force="zentorch_woq")))
    assert forced.kernel_name == "zentorch_woq" and forced.selection.forced


# ---- real checkpoints ------------------------------------------------------------

def _real_layers(fixture: str, limit: int = 6):
    from quill.formats.checkpoint import open_checkpoint
    from tests.fixture_util import fixture_path

    layers = []
    for name, qw in open_checkpoint(fixture_path(fixture)).quantized_layers():
        layers.append((name, qw))
        if len(layers) == limit:
            break
    return layers


@needs_zentorch
@pytest.mark.parametrize("fixture", ["ct-w8a8-dynamic-llama", "ct-w8a8-static-qwen2"])
def test_w8a8_checkpoints_run_on_zentorch_by_default(fixture):
    gen = torch.Generator().manual_seed(1)
    default, oracle = KernelSelector(HOST, NO_NATIVE), KernelSelector(HOST, KernelPolicy(force="reference"))
    for name, qw in _real_layers(fixture):
        layer = build_quant_linear(qw, default)
        assert layer.kernel_name == "zentorch", f"{fixture} {name}: {layer.selection.refusals}"
        x = torch.randn(2, 16, qw.in_features, generator=gen)
        assert sqnr_db(build_quant_linear(qw, oracle)(x), layer(x)) >= 60, f"{fixture} {name}"


@needs_zentorch
@pytest.mark.parametrize("fixture", ["ct-w4a16-actorder-llama", "ct-w4a16-asym-g32-qwen2",
                                     "ar-autogptq-asym-g128-llama", "ar-autoawq-asym-g64-qwen2"])
def test_w4a16_checkpoints_run_on_forced_zentorch_woq(fixture):
    gen = torch.Generator().manual_seed(2)
    forced, oracle = (KernelSelector(HOST, KernelPolicy(force=k)) for k in ("zentorch_woq", "reference"))
    for name, qw in _real_layers(fixture):
        x = torch.randn(2, 16, qw.in_features, generator=gen)
        assert sqnr_db(build_quant_linear(qw, oracle)(x), build_quant_linear(qw, forced)(x)) >= 40, f"{fixture} {name}"
