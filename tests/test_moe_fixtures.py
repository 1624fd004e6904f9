"""The real-tool MoE fixtures end to end: prompt log-probabilities vs reference logits, greedy vs transformers.

The oracle is the fixture README's: a float32 transformers model whose
quantized Linear weights are the tool's own dequantization
(expected.safetensors) and whose other tensors are the checkpoint's.
transformers 5 keeps experts fused in memory and names Mixtral's block
``mlp``; the twin below maps the per-expert checkpoint names onto that.
"""

import json
import re

import pytest
import torch
from safetensors import safe_open

import quill
from tests.fixture_util import expected_weights, fixture_names, fixture_path, reference
from tests.moe_models_util import fuse_experts

MOE = [n for n in fixture_names() if json.loads((fixture_path(n) / "config.json").read_text())["model_type"]
       in ("mixtral", "qwen3_moe")]


def test_the_three_moe_fixtures_are_here():
    assert MOE == ["ar-autogptq-qwen3moe", "ct-w4a16-mixtral", "ct-w4a16-qwen3moe"]


def prompt_logprobs(llm: quill.LLM, ids: torch.Tensor) -> list[torch.Tensor]:
    outs = llm.generate(ids.tolist(), quill.SamplingParams(max_tokens=1, prompt_logprobs=-1, temperature=0))
    vocab = llm.model.args.vocab_size
    return [torch.tensor([[lp[t].logprob for t in range(vocab)] for lp in o.prompt_logprobs[1:]]) for o in outs]


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("kernel,moe", [("reference", "reference"), (None, None)])
def test_prompt_logprobs_match_reference(name, kernel, moe):
    ref = reference(name)
    want = torch.log_softmax(ref["logits"], -1)  # [2, 16, V]
    llm = quill.LLM(str(fixture_path(name)), skip_tokenizer_init=True, kernel=kernel, moe_backend=moe,
                    kv_cache_dtype="float32")
    experts = [i for i in llm.loaded.layers if i.kind == "expert"]
    assert experts and {i.summary.split(" ")[0] for i in experts} == {"W4A16"}
    assert {i.kernel for i in experts} == {f"moe:{moe or 'grouped'}"}
    for row, got in enumerate(prompt_logprobs(llm, ref["input_ids"])):
        assert float((got - want[row, :-1]).abs().max()) < 1e-4


def transformers_twin(name: str):
    import transformers
    path = fixture_path(name)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config", None)
    config = transformers.AutoConfig.for_model(**cfg)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {}
    with safe_open(str(path / "model.safetensors"), "pt") as st:
        state.update({k: st.get_tensor(k).float() for k in st.keys()})
    state.update({f"{m}.weight": w for m, w in expected_weights(name).items()})
    state = {re.sub(r"\.block_sparse_moe\.", ".mlp.", k): v for k, v in state.items()}  # transformers 5's name
    state = {k: v for k, v in fuse_experts(state).items() if k in model.state_dict()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


@pytest.mark.parametrize("name", MOE)
def test_greedy_matches_transformers(name):
    ids = reference(name)["input_ids"].tolist()
    prompts = [ids[0], ids[1][:11]]  # different lengths: one row is left-padded in the batch
    llm = quill.LLM(str(fixture_path(name)), skip_tokenizer_init=True, kv_cache_dtype="float32")
    outs = llm.generate(prompts, quill.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    twin = transformers_twin(name)
    for prompt, out in zip(prompts, outs):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(12):
                seq.append(int(twin(torch.tensor([seq])).logits[0, -1].argmax()))
        assert out.token_ids == seq[len(prompt):]


def test_inspect_collapses_experts(capsys):
    from quill.cli import main
    assert main(["inspect", str(fixture_path("ct-w4a16-mixtral")), "--moe-backend", "reference"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("model.")}
    w1 = rows["model.layers.0.block_sparse_moe.experts.*.w1"]
    assert w1[1:8] == ["expert", "x4", "4", "32", "yes", "moe:reference", "W4A16"]
    assert not any(".experts.0." in name for name in rows)
    assert "moe experts: 0 of 2 MoE layers run their routed experts in one native call (the others: one call per" in out


def test_inspect_says_the_grouped_decode_runs_in_one_native_call(capsys):
    from quill.cli import main
    assert main(["inspect", str(fixture_path("ct-w4a16-qwen3moe"))]) == 0
    out = capsys.readouterr().out
    assert "moe experts: 2 of 2 MoE layers run their routed experts in one native call\n" in out
    assert "decode step: native: every decoder layer in one call\n" in out
