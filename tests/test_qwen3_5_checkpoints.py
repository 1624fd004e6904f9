"""Qwen3.5 dense and MoE quantized by a real tool: llm-compressor's GPTQ (W4A16, groups of 32), written by
tests/tools/make_qwen3_5_ct.py from tests/qwen3_5_util.py's tiny random models (tests/data/qwen3_5/).

The oracle is transformers loading the same checkpoint (compressed-tensors' own decompression) and running
its float32 forward: every quantized linear bit for bit, next-token log-probs over a prompt longer than two
DeltaNet chunks at every position, and greedy tokens.  The DeltaNet projections (in_proj_qkv / z / a / b,
out_proj), the gated attention's and the (shared) experts' linears are quantized; conv1d, A_log, dt_bias,
norms, routers and lm_head stay float, as the tool left them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quill.formats.checkpoint import open_checkpoint
from tests.engine_util import assert_checkpoint_greedy, assert_checkpoint_logprobs
from tests.qwen3_5_util import VOCAB

DATA = Path(__file__).parent / "data" / "qwen3_5"
NAMES = ["ct-w4a16-g32-qwen3_5_text", "ct-w4a16-g32-qwen3_5_moe_text"]
PROMPT = torch.randint(4, VOCAB, (150,), generator=torch.Generator().manual_seed(5)).tolist()  # > 2 chunks of 64


@pytest.fixture(scope="module", params=NAMES)
def fixture(request):
    """(checkpoint dir, transformers' float32 model of it, its log-probs of PROMPT[1:])."""
    from transformers import AutoModelForCausalLM

    d = DATA / request.param
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), -1)[:-1]
    return d, hf, want


def test_the_tool_wrote_what_the_tests_read(fixture):
    d, hf, _ = fixture
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    group = qc["config_groups"]["group_0"]["weights"]
    assert (group["num_bits"], group["group_size"], group["symmetric"]) == (4, 32, True)
    names = [name for name, _ in open_checkpoint(d).quantized_layers()]
    assert any(".linear_attn.in_proj_qkv" in n for n in names) and any(".self_attn.q_proj" in n for n in names)


def _hf_weight(hf, name: str) -> torch.Tensor:
    """transformers' float32 weight of the checkpoint's linear ``name`` (fused experts split back)."""
    if ".mlp.experts." not in name:
        return hf.get_submodule(name).weight
    prefix, e, proj = name.rsplit(".", 2)
    experts = hf.get_submodule(prefix)  # model.layers.L.mlp.experts
    e = int(e)
    if proj == "down_proj":
        return experts.down_proj[e]  # [H, I]
    gate_up = experts.gate_up_proj[e]  # [2 I, H]: gate rows, then up rows
    inter = gate_up.shape[0] // 2
    return gate_up[:inter] if proj == "gate_proj" else gate_up[inter:]


def test_every_quantized_linear_dequantizes_as_the_tool_does(fixture):
    d, hf, _ = fixture
    n = 0
    for name, qw in open_checkpoint(d).quantized_layers():
        want = _hf_weight(hf, name)
        assert torch.equal(qw.dequantize(), want.float()), name
        n += 1
    assert n == (31 + 72 if "moe" in d.name else 31)  # the linears and the experts' (6 x 3 x 4 layers)


@pytest.mark.parametrize("kernel", ["reference", None])
def test_next_token_logprobs_match_transformers_at_every_position(fixture, kernel):
    d, _, want = fixture
    assert_checkpoint_logprobs(d, PROMPT, want, kernel)


def test_greedy_tokens_equal_transformers(fixture):
    d, hf, _ = fixture
    assert_checkpoint_greedy(d, hf, PROMPT[:40])
