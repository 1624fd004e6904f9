"""Gemma 3, Gemma 4 and gpt-oss quantized by real tools: llm-compressor's GPTQ (compressed-tensors W4A16, groups of
32; tests/tools/make_windowed_ct.py: all three) and auto-round (its own GPTQ-packed format, W4 groups of 32;
tests/tools/make_windowed_ar.py: Gemma 3 and gpt-oss), from the tests' tiny random models (tests/data/windowed/;
the tool scripts say what each tool refused).

Every quantized linear is checked bit for bit against the tool's own dequantization (compressed-tensors'
unpacking and dequantize; auto-round's QuantLinear, in expected.safetensors); the model against transformers'
float32 forward of those weights (a plain model from the config, the checkpoint's other tensors upcast):
next-token log-probs at every position of a prompt six windows long, and greedy tokens.  Both tools write
gpt-oss's fused experts as one Linear per expert and projection (gate_proj, up_proj, down_proj, with biases),
a layout transformers 5.23 does not load back: the oracle puts them back into its fused layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from quill.formats.checkpoint import open_checkpoint
from tests.engine_util import assert_checkpoint_greedy, assert_checkpoint_logprobs

DATA = Path(__file__).parent / "data" / "windowed"
NAMES = ["ct-w4a16-g32-gemma3_text", "ct-w4a16-g32-gemma4_text", "ct-w4a16-g32-gpt_oss",
         "ar-autoround-g32-gemma3_text", "ar-autoround-g32-gpt_oss"]
VOCAB = 320
PROMPT = torch.randint(4, VOCAB, (96,), generator=torch.Generator().manual_seed(5)).tolist()  # six windows of 16
PACKED = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point", ".qweight", ".qzeros", ".scales",
          ".g_idx")  # the tools' per-linear tensors (both formats)


def tool_weights(d: Path) -> dict[str, torch.Tensor]:
    """Linear name -> its weight as the tool dequantizes it (float32)."""
    if d.name.startswith("ar-"):
        return load_file(str(d / "expected.safetensors"))  # auto-round's QuantLinear, at fixture time
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs(**qc["config_groups"]["group_0"]["weights"])
    f = safe_open(str(d / "model.safetensors"), "pt")
    out = {}
    for key in f.keys():
        if key.endswith(".weight_packed"):
            name = key.removesuffix(".weight_packed")
            shape = torch.Size(f.get_tensor(f"{name}.weight_shape").tolist())
            codes = unpack_from_int32(f.get_tensor(key), args.num_bits, shape)
            out[name] = dequantize(codes, f.get_tensor(f"{name}.weight_scale"), None, args).float()
    return out


def oracle(d: Path, weights: dict[str, torch.Tensor]):
    """transformers' float32 model of ``d``: the tool's dequantized linears, every other tensor as stored."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(d)
    del cfg.quantization_config
    cfg._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    f = safe_open(str(d / "model.safetensors"), "pt")
    state = {k: f.get_tensor(k).float() for k in f.keys() if not k.endswith(PACKED)}
    state |= {f"{name}.weight": w for name, w in weights.items()}
    if cfg.model_type == "gpt_oss":
        state = _fused_experts(state, cfg)
    if cfg.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    hf.load_state_dict(state, strict=True)
    return hf


def _fused_experts(state: dict, cfg) -> dict:
    """transformers' gpt-oss expert tensors from per-expert linears: gate_up_proj [E, H, 2 I] with the gate in
    even columns and up in odd ones, down_proj [E, I, H] (each a linear's weight transposed), their biases."""
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts"
        pick = lambda proj, part: [state.pop(f"{p}.{e}.{proj}.{part}") for e in range(cfg.num_local_experts)]  # noqa: E731
        gate, up = torch.stack(pick("gate_proj", "weight")), torch.stack(pick("up_proj", "weight"))  # [E, I, H]
        gate_b, up_b = torch.stack(pick("gate_proj", "bias")), torch.stack(pick("up_proj", "bias"))  # [E, I]
        state[f"{p}.gate_up_proj"] = torch.stack([gate.transpose(1, 2), up.transpose(1, 2)], -1).flatten(-2)
        state[f"{p}.gate_up_proj_bias"] = torch.stack([gate_b, up_b], -1).flatten(-2)
        state[f"{p}.down_proj"] = torch.stack(pick("down_proj", "weight")).transpose(1, 2)  # [E, I, H]
        state[f"{p}.down_proj_bias"] = torch.stack(pick("down_proj", "bias"))
    return state


@pytest.fixture(scope="module", params=NAMES)
def fixture(request):
    """(checkpoint dir, the tool's weights, transformers' float32 model of them, its log-probs of PROMPT[1:])."""
    d = DATA / request.param
    weights = tool_weights(d)
    hf = oracle(d, weights)
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), -1)[:-1]
    return d, weights, hf, want


def test_every_quantized_linear_dequantizes_as_the_tool_does(fixture):
    d, weights, _, _ = fixture
    names = []
    for name, qw in open_checkpoint(d).quantized_layers():
        assert torch.equal(qw.dequantize(), weights[name]), name
        names.append(name)
    # gpt-oss: attention's four linears in each of 4 layers and 4 experts x 3 projections; Gemma 3: 4 x 7;
    # Gemma 4: 6 x (7 + the per-layer input gate and projection), less the 3 global layers' v_proj (their
    # values are their keys), and the per-layer model projection
    assert len(names) == {"gpt_oss": 16 + 48, "gemma3_text": 28, "gemma4_text": 52}[d.name.rsplit("-", 1)[1]], names


@pytest.mark.parametrize("kernel", ["reference", None])
def test_next_token_logprobs_match_transformers_at_every_position(fixture, kernel):
    d, _, _, want = fixture
    assert_checkpoint_logprobs(d, PROMPT, want, kernel)


def test_greedy_tokens_equal_transformers(fixture):
    d, _, hf, _ = fixture
    # Gemma 4 runs the Python layers (tests/test_gemma4.py: the step says why); the others the native step
    assert_checkpoint_greedy(d, hf, PROMPT[:40], native_step="gemma4" not in d.name)
