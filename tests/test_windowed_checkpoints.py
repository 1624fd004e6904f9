"""Gemma 3, Gemma 4 and gpt-oss quantized by real tools: llm-compressor's GPTQ (compressed-tensors W4A16, groups of
32; tests/tools/make_windowed_ct.py: all three), auto-round (its own GPTQ-packed format, W4 groups of 32;
tests/tools/make_windowed_ar.py: Gemma 3 and gpt-oss) and GPTQModel (GPTQ v1, 4 bits, groups of 32, desc_act;
tests/tools/make_windowed_gptq.py: all three, Gemma 4 with KV-shared layers), from the tests' tiny random models
(tests/data/windowed/; the tool scripts say what each tool refused).

Every quantized linear is checked bit for bit against the tool's own dequantization (compressed-tensors'
unpacking and dequantize; auto-round's QuantLinear and GPTQModel's TorchLinear, in expected.safetensors); the model
against transformers' float32 forward of those weights (a plain model from the config, the checkpoint's other
tensors upcast): next-token log-probs at every position of a prompt six windows long, and greedy tokens.  The tools
write gpt-oss's fused experts as one Linear per expert and projection (gate_proj, up_proj, down_proj, with biases),
a layout transformers 5.23 does not load back: the oracle puts them back into its fused layout, where gate and up
are interleaved (gate j is column 2 j).  llm-compressor and auto-round write the true gate and up; GPTQModel writes
the fused projection's halves under those names (make_windowed_gptq.py checks both against the source model).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import quill
from quill.errors import CheckpointError
from quill.formats.checkpoint import open_checkpoint
from tests.engine_util import assert_checkpoint_greedy, assert_checkpoint_logprobs

DATA = Path(__file__).parent / "data" / "windowed"
NAMES = ["ct-w4a16-g32-gemma3_text", "ct-w4a16-g32-gemma4_text", "ct-w4a16-g32-gpt_oss",
         "ar-autoround-g32-gemma3_text", "ar-autoround-g32-gpt_oss",
         "gptqmodel-g32-gemma3_text", "gptqmodel-g32-gemma4_text", "gptqmodel-g32-gpt_oss"]
VOCAB = 320
PROMPT = torch.randint(4, VOCAB, (96,), generator=torch.Generator().manual_seed(5)).tolist()  # six windows of 16
PACKED = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point", ".qweight", ".qzeros", ".scales",
          ".g_idx")  # the tools' per-linear tensors (both formats)


def tool_weights(d: Path) -> dict[str, torch.Tensor]:
    """Linear name -> its weight as the tool dequantizes it (float32)."""
    if not d.name.startswith("ct-"):
        return load_file(str(d / "expected.safetensors"))  # auto-round's QuantLinear, GPTQModel's TorchLinear
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
        state = _fused_experts(state, cfg, halves=d.name.startswith("gptqmodel-"))
    if cfg.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    hf.load_state_dict(state, strict=True)
    return hf


def _fused_experts(state: dict, cfg, halves: bool = False) -> dict:
    """transformers' gpt-oss expert tensors from per-expert linears: gate_up_proj [E, H, 2 I] with the gate in
    even columns and up in odd ones, down_proj [E, I, H] (each a linear's weight transposed), their biases.
    ``halves``: gate_proj and up_proj are the first and second half of gate_up_proj's columns (GPTQModel's)."""
    join = (lambda a, b: torch.cat([a, b], -1)) if halves else (lambda a, b: torch.stack([a, b], -1).flatten(-2))  # noqa: E731
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts"
        pick = lambda proj, part: [state.pop(f"{p}.{e}.{proj}.{part}") for e in range(cfg.num_local_experts)]  # noqa: E731
        gate, up = torch.stack(pick("gate_proj", "weight")), torch.stack(pick("up_proj", "weight"))  # [E, I, H]
        gate_b, up_b = torch.stack(pick("gate_proj", "bias")), torch.stack(pick("up_proj", "bias"))  # [E, I]
        state[f"{p}.gate_up_proj"] = join(gate.transpose(1, 2), up.transpose(1, 2))
        state[f"{p}.gate_up_proj_bias"] = join(gate_b, up_b)
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
    # values are their keys), and the per-layer model projection (GPTQModel keeps that one dense, and its
    # fixture's last two layers are KV-shared: no k_proj, v_proj in either, so 6 x 9 - 3 - 3)
    want = {"gpt_oss": 16 + 48, "gemma3_text": 28, "gemma4_text": 52}[d.name.rsplit("-", 1)[1]]
    assert len(names) == (48 if d.name == "gptqmodel-g32-gemma4_text" else want), names


@pytest.mark.parametrize("kernel", ["reference", None])
def test_next_token_logprobs_match_transformers_at_every_position(fixture, kernel):
    d, _, _, want = fixture
    assert_checkpoint_logprobs(d, PROMPT, want, kernel)


def test_greedy_tokens_equal_transformers(fixture):
    d, _, hf, _ = fixture
    # Gemma 4 runs the Python layers (tests/test_gemma4.py: the step says why); the others the native step
    assert_checkpoint_greedy(d, hf, PROMPT[:40], native_step="gemma4" not in d.name)


# ---- GPTQModel's gpt-oss experts: gate_proj / up_proj are the halves of the fused projection ------------------

GPTQMODEL_OSS = DATA / "gptqmodel-g32-gpt_oss"


def _edited_copy(tmp_path: Path, edit) -> Path:
    """GPTQMODEL_OSS copied to ``tmp_path`` with ``edit(tensors)`` applied to its model.safetensors."""
    from safetensors.torch import save_file

    d = tmp_path / GPTQMODEL_OSS.name
    shutil.copytree(GPTQMODEL_OSS, d)
    f = safe_open(str(GPTQMODEL_OSS / "model.safetensors"), "pt")
    tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def _dense_half(tensors: dict, name: str, weight: torch.Tensor) -> None:
    """Module ``name`` stored dense (the tool's weight of it, its bias kept), as GPTQModel leaves a layer its
    ``dynamic`` rules exclude."""
    for suffix in (".qweight", ".qzeros", ".scales", ".g_idx"):
        del tensors[name + suffix]
    tensors[f"{name}.weight"] = weight


def test_gptqmodel_gpt_oss_dense_halves_are_regrouped_as_quantized_ones(tmp_path):
    weights = tool_weights(GPTQMODEL_OSS)
    halves = [f"model.layers.{i}.mlp.experts.{e}.{p}" for i, e in ((0, 1), (3, 2)) for p in ("gate_proj", "up_proj")]
    d = _edited_copy(tmp_path, lambda t: [_dense_half(t, n, weights[n]) for n in halves])
    with torch.no_grad():
        want = torch.log_softmax(oracle(GPTQMODEL_OSS, weights)(torch.tensor([PROMPT])).logits[0], -1)[:-1]
    assert_checkpoint_logprobs(d, PROMPT, want, "reference")


def test_gptqmodel_gpt_oss_halves_that_cannot_be_joined_are_refused(tmp_path):
    weights = tool_weights(GPTQMODEL_OSS)
    name = "model.layers.2.mlp.experts.3.up_proj"
    d = _edited_copy(tmp_path, lambda t: _dense_half(t, name, weights[name]))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.2\.mlp\.experts\.3\.gate_proj' \(quantized\) and "
                       r"'model\.layers\.2\.mlp\.experts\.3\.up_proj' \(dense\) are the two halves of expert 3's "
                       r"fused gate_up projection"):
        quill.LLM(str(d), skip_tokenizer_init=True, progress=False)


def test_gptqmodel_gpt_oss_loads_from_the_prepacked_cache(tmp_path):
    greedy = quill.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)

    def answer(cache: bool) -> tuple:
        llm = quill.LLM(str(GPTQMODEL_OSS), skip_tokenizer_init=True, progress=False, cache=cache, cache_dir=tmp_path)
        if llm.cache is not None:
            llm.cache.wait()
        out = llm.generate([PROMPT[:12]], greedy)[0]
        return llm.cache_hit, out.token_ids, [{k: v.logprob for k, v in p.items()} for p in out.logprobs]

    plain, miss, hit = answer(False), answer(True), answer(True)
    assert (miss[0], hit[0]) == (False, True)
    assert plain[1:] == miss[1:] == hit[1:]
