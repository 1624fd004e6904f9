"""One MoE path for every format: a tiny Qwen3-MoE written as AWQ, GPTQ v1 (act-order) / v2, AutoRound
and compressed-tensors files by quill's format writers, loaded through ``quill.LLM``, against transformers
holding the canonical dequantized weights (routers, norms and embeddings stay float, as the tools leave them).
"""

import json

import pytest
import torch
from safetensors.torch import save_file

import quill
from quill.writers.awq import canonical_to_awq
from quill.writers.compressed_tensors import (
    quantization_config,
    scheme_config,
    to_compressed_tensors,
)
from quill.writers.gptq import canonical_to_gptq
from quill.writers.rtn import quantize_rtn
from tests.moe_models_util import fuse_experts, hf_moe_model, split_experts

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32}
FORMATS = {  # name -> (quantize_rtn settings, tensor writer, quantization_config)
    "awq-gemm": (dict(bits=4, group_size=32, symmetric=False), canonical_to_awq,
                 {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}),
    "gptq-v1-act-order": (dict(bits=4, group_size=32, act_order=True), lambda qw: canonical_to_gptq(qw, v1=True),
                          {**GPTQ, "sym": True, "desc_act": True}),
    "gptq-v2-asym-8bit": (dict(bits=8, group_size=32, symmetric=False), lambda qw: canonical_to_gptq(qw, v1=False),
                          {**GPTQ, "bits": 8, "sym": False, "desc_act": False, "checkpoint_format": "gptq_v2"}),
    "auto-round": (dict(bits=4, group_size=32), lambda qw: canonical_to_gptq(qw, v1=True),
                   {"quant_method": "auto-round", "bits": 4, "group_size": 32, "sym": True, "data_type": "int",
                    "packing_format": "auto_round:auto_gptq", "block_name_to_quantize": "model.layers"}),
    "compressed-tensors-w8a16": (dict(bits=8, group_size=-1), to_compressed_tensors, None),
}


def write(hf, fmt: str, path):
    """Quantize the experts and attention of ``hf`` into ``fmt`` files; return the dequantized twin state."""
    settings, writer, qcfg = FORMATS[fmt]
    state = split_experts({k: v.detach().float() for k, v in hf.state_dict().items()})
    state.pop("lm_head.weight", None)  # tied
    gen = torch.Generator().manual_seed(3)
    tensors, twin = {}, dict(state)
    for name, w in state.items():
        module = name.removesuffix(".weight")
        if not name.endswith("_proj.weight"):
            tensors[name] = w
            continue
        qw = quantize_rtn(w, generator=gen, **settings)
        qw = qw.with_(name=module)
        tensors.update({f"{module}.{k}": t for k, t in writer(qw).items()})
        twin[name] = qw.dequantize()
        if qcfg is None:
            qcfg = quantization_config({"group_0": scheme_config(qw)})
    path.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**hf.config.to_dict(), "quantization_config": qcfg}))
    return fuse_experts(twin)


@pytest.fixture(scope="module")
def hf():
    return hf_moe_model("qwen3_moe", seed=30)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_format_through_the_moe_path(hf, fmt, tmp_path):
    twin_state = write(hf, fmt, tmp_path / fmt)
    twin = hf_moe_model("qwen3_moe", seed=30)
    missing, unexpected = twin.load_state_dict(twin_state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ids = torch.randint(4, 320, (2, 10), generator=torch.Generator().manual_seed(31))
    with torch.no_grad():
        want = torch.log_softmax(twin(ids).logits, -1)  # [2, 10, V]
    llm = quill.LLM(str(tmp_path / fmt), skip_tokenizer_init=True, kernel="reference", kv_cache_dtype="float32")
    experts = [i for i in llm.loaded.layers if i.kind == "expert"]
    assert len(experts) == 2 * 8 * 3 and {i.kernel for i in experts} == {"moe:grouped"}
    outs = llm.generate(ids.tolist(), quill.SamplingParams(max_tokens=1, prompt_logprobs=-1, temperature=0))
    for row, out in enumerate(outs):
        got = torch.tensor([[lp[t].logprob for t in range(320)] for lp in out.prompt_logprobs[1:]])
        assert float((got - want[row, :-1]).abs().max()) < 1e-4
