"""The float-activation study (quill/bench/accuracy/float_acts.py) emulates the images it scores.

Its conclusions rest on two things checked here: its 24-bit emulation is what the native float kernel
computes (so the cheaper images are measured against the real thing), and each image rounds every
input to within half a step of its segment's grid.
"""

import pytest
import torch

from quill.bench.accuracy.float_acts import IMAGE_QMAX, round_input
from quill.kernels import LinearLayerConfig
from quill.kernels.selection import kernel_class
from quill.platform import detect
from quill.writers.rtn import quantize_rtn

NATIVE = kernel_class("native_w4a16")


def inputs(seed: int = 0) -> torch.Tensor:
    """float32 [5, 256], one input channel 300x the rest (as AWQ's folded scales make)."""
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(seed))
    x[:, 7] *= 300
    return x


@pytest.mark.parametrize("variant", sorted(IMAGE_QMAX))
def test_each_image_rounds_to_half_a_step_of_its_segment(variant):
    x = inputs()
    step = x.view(5, 4, 64).abs().amax(-1, keepdim=True) / IMAGE_QMAX[variant]  # [5, 4, 1]
    err = (round_input(x, variant, 64) - x).view(5, 4, 64).abs()
    f32 = x.view(5, 4, 64).abs() * 2.0**-23  # float32's rounding of q x scale (a 24-bit q has no spare bits)
    assert bool((err <= step / 2 + f32).all())
    assert variant == "image24" or err.max() > 0  # the 16-bit image really rounds


def test_the_emulations_are_the_native_kernel():
    """The 24-bit emulation is the native exact mode; the 16-bit image rounded to the native kernel's 32639
    steps is its default (the study's image16 rounds to 32767, 0.4 % finer)."""
    platform = detect()
    qw = quantize_rtn(torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.02, 4, 64,
                      symmetric=False)
    cfg = LinearLayerConfig.from_weight(qw, platform, exact_float=True)
    reason = NATIVE.supported(platform) or NATIVE.can_implement(cfg)
    if reason:
        pytest.skip(reason)
    x = inputs()
    w = qw.dequantize()  # float32 [64, 256]
    native = NATIVE.apply(NATIVE.prepare(qw, cfg), x).float()  # [5, 64], the exact mode
    err = {v: (round_input(x, v, 64) @ w.T - native).abs().max().item() for v in ("image24", "image16", "exact")}
    assert err["image24"] * 10 < err["image16"], err
    assert err["exact"] * 10 < err["image16"], err
    native16 = NATIVE.apply(NATIVE.prepare(qw, LinearLayerConfig.from_weight(qw, platform)), x).float()  # default
    segs = x.view(5, 4, 64)
    step = segs.abs().amax(-1, keepdim=True) / 32639  # [5, 4, 1]
    emulated = ((segs / step).round() * step).view(5, 256) @ w.T
    assert (emulated - native16).abs().max().item() * 10 < (native - native16).abs().max().item()
