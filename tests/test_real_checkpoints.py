"""Real trained weights, quantized by the real tool, against the tool's own forward.

tests/data/real/ holds SmolLM2-135M-Instruct (the default model's weights), cut to
2 decoder layers and the first 4096 tokens, quantized by llm-compressor 0.14 /
compressed-tensors 0.19 (scripts/make_real_checkpoints.py says exactly how), each
with transformers' float32 log-probabilities over every prompt position.

* ``awq-w4a16``: AWQModifier (activation scales folded into the RMSNorm weights, so
  a few input channels are far larger than the rest). Every float-activation kernel
  must reproduce transformers at every position, and its greedy text: issue 9 asks for
  1e-2; measured 3-6e-5 on every exact kernel, so their bound here is 1e-3, which the
  native kernels' 16-bit activation image (their default; 1.9e-3 on this cut) would fail:
  it is held to 1e-2, and the native exact mode (activation_quant="exact") to 1e-3.
* ``w8a8``: int8 weights per channel, int8 activations dynamic per token. Each
  quantized Linear, fed the very activations the tool's forward produced, must give
  the tool's output (compressed-tensors' own code, run here) to float32 rounding, on
  the reference kernel and on the native int8 kernel. End to end the forward is
  discontinuous: per-token rounding of activations with outlier channels turns a
  one-ulp difference anywhere upstream into a different int8 code, and the tool does
  not agree with itself either (eager vs SDPA attention, same library: up to 6.5e-3 on
  this 2-layer cut, 0.8-3 nats on the full 30-layer model). So end to end the check is
  greedy text plus agreement on most positions, with the tool's own spread reported.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import quill
from quill.kernels.selection import kernel_class
from quill.platform import detect

DATA = Path(__file__).resolve().parent / "data" / "real"
GREEDY = 16


def reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(DATA / name / "reference.safetensors"))


def prompts(ref: dict[str, torch.Tensor]) -> list[list[int]]:
    return [ref[f"ids{i}"].tolist() for i in range(sum(k.startswith("ids") for k in ref))]


def quill_logprobs(llm: quill.LLM, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """log-probs [T - 1, V] at prompt positions 0..T-2 (predicting tokens 1..T-1), and greedy tokens."""
    out = llm.generate([ids], quill.SamplingParams(max_tokens=GREEDY, temperature=0, ignore_eos=True,
                                                   prompt_logprobs=-1))[0]
    vocab = len(out.prompt_logprobs[1])
    got = torch.tensor([[lp[t].logprob for t in range(vocab)] for lp in out.prompt_logprobs[1:]])
    return got, out.token_ids


# (kernel, activation_quant, bound): the exact mode of the native kernels ("exact": the 24-bit image)
# and the exact kernels at 1e-3; the default (the native 16-bit image) at issue 9's 1e-2
@pytest.mark.parametrize("kernel,acts,bound", [(None, "exact", 1e-3), ("native_w4a16", "exact", 1e-3),
                                               ("reference", "auto", 1e-3), ("torch", "auto", 1e-3),
                                               (None, "auto", 1e-2)])
def test_awq_float_activation_kernels_match_transformers(kernel, acts, bound):
    ref = reference("awq-w4a16")
    llm = quill.LLM(str(DATA / "awq-w4a16"), kernel=kernel, skip_tokenizer_init=True, activation_quant=acts,
                    kv_cache_dtype="float32")  # the tool's forward: a float cache
    for i, ids in enumerate(prompts(ref)):
        got, greedy = quill_logprobs(llm, ids)
        err = float((got - ref[f"logprobs{i}"][:-1]).abs().max())
        assert err < bound, f"prompt {i}: max |d logprob| {err:.2e}"
        assert greedy == ref[f"greedy{i}"].tolist()


def tool_linear_io(name: str) -> tuple[dict[str, list[tuple[torch.Tensor, torch.Tensor]]], dict]:
    """The tool's forward (transformers + compressed-tensors, float32): each Linear's (input, output) per prompt."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(DATA / name), dtype=torch.float32, attn_implementation="eager").eval()
    io: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module_name != "lm_head":
            module.register_forward_hook(
                lambda m, a, o, n=module_name: io.setdefault(n, []).append((a[0][0].clone(), o[0].clone())))
    ref = reference(name)
    with torch.no_grad():
        for ids in prompts(ref):
            model(torch.tensor([ids]))
    return io, ref


@pytest.fixture(scope="module")
def w8a8_io():
    return tool_linear_io("w8a8")


@pytest.mark.parametrize("kernel", ["reference", "native_w8a8", "zentorch"])
def test_w8a8_linears_reproduce_compressed_tensors(w8a8_io, kernel):
    """Fed the tool's own activations (real outliers), every W8A8 layer gives the tool's output."""
    io, _ = w8a8_io
    refusal = kernel_class(kernel).supported(detect())  # zentorch: AMD Zen with AVX-512 and the plugin only
    if refusal is not None:
        pytest.skip(f"kernel '{kernel}' cannot run on this machine: {refusal}")
    llm = quill.LLM(str(DATA / "w8a8"), kernel=kernel, skip_tokenizer_init=True)
    assert len(io) == 14
    for module_name, calls in io.items():
        layer = llm.model.get_submodule(module_name)
        for x, want in calls:
            with torch.no_grad():
                got = layer(x[None])[0]  # [T, N]
            # same int8 codes on both sides: what is left is float32 summation order
            tol = 2e-5 * float(want.abs().max())
            err = float((got - want).abs().max())
            assert err <= tol, f"{kernel} {module_name}: max |diff| {err:.2e} > {tol:.2e}"


@pytest.mark.parametrize("kernel", [None, "reference"])
def test_w8a8_end_to_end_against_transformers(kernel):
    """Most positions agree to float noise; where a rounding flip cascades, the difference stays bounded.

    A systematic defect (a wrong scale, a missed ``ignore`` entry: issue 9 suspected one at 2-4
    nats) moves every position; a flip moves the positions after it.  So the pooled median
    must be float noise, and no position may be off by a whole nat.  (Measured on a Zen 4:
    median 1.5e-5 / 3.8e-5, 69-72 % of 32 positions within 1e-2, max 0.33.)
    """
    ref = reference("w8a8")
    llm = quill.LLM(str(DATA / "w8a8"), kernel=kernel, skip_tokenizer_init=True,
                    kv_cache_dtype="float32")  # the tool's forward: a float cache
    per_position, spread = [], []
    for i, ids in enumerate(prompts(ref)):
        got, _ = quill_logprobs(llm, ids)
        per_position += (got - ref[f"logprobs{i}"][:-1]).abs().amax(-1).tolist()
        spread.append(float((ref[f"logprobs_sdpa{i}"] - ref[f"logprobs{i}"]).abs().max()))
    per_position = torch.tensor(per_position)
    assert max(spread) > 1e-3  # the tool against itself: the forward is that sensitive
    assert float(per_position.median()) < 1e-3, per_position
    assert float(per_position.max()) < 1.0, per_position
