"""Smoothing invariance: activation outliers moved in by AWQ / SmoothQuant-style scaling cost no accuracy.

AWQ folds per-channel activation scales into the RMSNorm weight before a layer's
linears and divides those linears' input columns by the same scales, so the float
model is unchanged while a few input channels become far larger than the rest.
Here the same transformation is applied by hand (factors up to 100x), the model
is re-quantized, and every kernel that takes float32 activations must stay within
1e-2 log-probability of the float32 forward of the very same quantized weights
(with the earlier 16-bit activation image, native_w4a16 / native_w8a16 were at 1.9e-2 / 2.7e-2).
The torch kernel runs here on its int4pack / int8pack paths; its dense fallback (layouts
neither op takes) computes in bfloat16 and is ~8e-2 from float32 on this model with or
without smoothing (bfloat16's own rounding, not the activation range).
"""

import pytest
import torch

from quill.engine.loader import build_model
from quill.kernels import KernelPolicy, KernelSelector
from quill.models.base import ForwardContext
from quill.platform import detect
from tests.model_util import MemoryCheckpoint, hf_model

# zentorch_woq (opt-in only) computes in bfloat16, whose error is per element and does not
# depend on the range; it is ~0.1 here with or without smoothing, so it is not in this list.
FLOAT_KERNELS = ["reference", "torch", "native_w4a16", "native_w8a16"]
WEIGHT_BITS = {"native_w4a16": 4, "native_w8a16": 8}
LAYERS = 4
HIDDEN = 256
MAX_FACTOR = 100.0
# (norm, linears whose input it scales)
SMOOTHED = [("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))]


def smoothing_factors(n: int, seed: int) -> torch.Tensor:
    """Per-channel factors in [1, 100]: most near 1, a few channels at 30-100x (AWQ's outliers)."""
    g = torch.Generator().manual_seed(seed)
    f = MAX_FACTOR ** (torch.rand(n, generator=g) ** 4)  # skewed towards 1
    f[torch.randperm(n, generator=g)[:4]] = torch.tensor([MAX_FACTOR, 70.0, 50.0, 30.0])
    return f


def smoothed_state(hf) -> dict[str, torch.Tensor]:
    """hf's state with every norm -> linears pair smoothed; the float function is unchanged."""
    state = {k: v.detach().clone().float() for k, v in hf.state_dict().items()}
    for layer in range(LAYERS):
        for j, (norm, linears) in enumerate(SMOOTHED):
            f = smoothing_factors(HIDDEN, seed=10 * layer + j)
            state[f"model.layers.{layer}.{norm}.weight"] *= f
            for lin in linears:
                state[f"model.layers.{layer}.{lin}.weight"] /= f  # [out, in]: input columns
    return state


@pytest.fixture(scope="module")
def smoothed():
    hf = hf_model("llama", seed=3, hidden_size=HIDDEN, intermediate_size=384, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    ids = torch.randint(4, 320, (2, 12), generator=torch.Generator().manual_seed(5))
    state = smoothed_state(hf)
    with torch.no_grad():
        before = hf(ids).logits
        hf.load_state_dict(state)
        assert torch.allclose(hf(ids).logits, before, rtol=1e-4, atol=1e-4)  # the float model is unchanged
    return hf, state, ids


# AWQ's usual 4-bit layout (zero point, group 64) and compressed-tensors' W8A16 (symmetric, per channel)
SCHEMES = {4: dict(bits=4, group_size=64, symmetric=False), 8: dict(bits=8, group_size=-1, symmetric=True)}


def quantized(hf, state, bits: int) -> MemoryCheckpoint:
    plan = {k.removesuffix(".weight"): SCHEMES[bits] for k in state if k.endswith("_proj.weight")}
    return MemoryCheckpoint(hf.config.to_dict(), state, plan)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kernel", FLOAT_KERNELS)
def test_float_activation_kernels_survive_outliers(smoothed, kernel, bits):
    hf, state, ids = smoothed
    if WEIGHT_BITS.get(kernel, bits) != bits:
        pytest.skip(f"{kernel} runs {WEIGHT_BITS[kernel]}-bit weights")
    ckpt = quantized(hf, state, bits)
    model = build_model(ckpt, KernelSelector(detect(), KernelPolicy(force=kernel), exact_float=True)).model
    missing, unexpected = hf.load_state_dict(ckpt.reference_state(), strict=False)
    assert not missing and not unexpected
    with torch.no_grad():
        want = torch.log_softmax(hf(ids).logits, -1)  # float32, the same quantized weights
        got = torch.log_softmax(model(ids, ForwardContext.causal(*ids.shape)), -1)
    err = float((got - want).abs().max())
    assert err < 1e-2, f"{kernel}, {bits}-bit weights: max |d logprob| {err:.2e}"
