"""gpt-oss as GGUF files written by llama.cpp's own converter and quantizer: MXFP4_MOE (experts MXFP4, the rest
Q8_0: the format users download) and Q8_0, against transformers' float32 forward on the same (dequantized)
weights, at every position of a prompt several windows long.  The file says the window and YaRN's factor,
original context and betas; llama.cpp assumes the rest (the window on every other layer from the first, the
clamped SwiGLU's 1.702 and 7), which the model here is made with."""

from __future__ import annotations

import pytest
import torch

import quill
from quill.formats.gguf.checkpoint import GGUFCheckpoint
from tests.llamacpp_util import convert, quantize, save_smollm2_tokenizer
from tests.model_util import save_hf_dir
from tests.test_gpt_oss import WINDOW, hf_gpt_oss, scored

GGUF_VOCAB = 49152  # the SmolLM2 tokenizer the converter recognises
# rows of whole 32-weight blocks (Q8_0, MXFP4): hidden 96, experts' intermediate 64, 4 heads of 16
GGUF_CONFIG = dict(vocab_size=GGUF_VOCAB, hidden_size=96, intermediate_size=64, num_attention_heads=4)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    hf = hf_gpt_oss(seed=5, **GGUF_CONFIG)
    d = save_hf_dir(hf, tmp_path_factory.mktemp("gptossgguf") / "hf", tokenizer=False)
    save_smollm2_tokenizer(d)
    f32 = convert(d, d / "f32.gguf", "f32")
    return hf, {q: quantize(f32, d / f"{q}.gguf", q) for q in ("MXFP4_MOE", "Q8_0")}


def reference(hf, path):
    """``hf`` with the GGUF file's weights, dequantized, back in transformers' stacked, interleaved layout."""
    ckpt = GGUFCheckpoint(path)
    state = {}
    for m, qw in ckpt.quantized_layers():
        state[f"{m}.weight"] = qw.dequantize()
        if qw.bias is not None:  # the file's float bias, attached to its quantized layer
            state[f"{m}.bias"] = qw.bias.float()
    state.update({k: t.float() for k, t in ckpt.dense_tensors()})
    ref = type(hf)(hf.config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("sinks"):
                p.copy_(state.pop(f"{name}.weight"))
            elif ".mlp.router." in name:
                p.copy_(state.pop(name.replace(".router.", ".gate.")))
            elif ".mlp.experts." in name:
                prefix, _, proj = name.rpartition(".")
                E = hf.config.num_local_experts
                part = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",),
                        "gate_up_proj_bias": ("gate_proj", "up_proj"), "down_proj_bias": ("down_proj",)}[proj]
                kind = "bias" if proj.endswith("_bias") else "weight"
                per = [torch.stack([state.pop(f"{prefix}.{e}.{x}.{kind}") for x in part], -1).flatten(-2)
                       if kind == "bias" else
                       torch.stack([state.pop(f"{prefix}.{e}.{x}.{kind}").T for x in part], -1).flatten(-2)
                       for e in range(E)]  # gate and up interleaved again, as GptOssExperts reads them
                p.copy_(torch.stack(per))
            else:
                p.copy_(state.pop(name))
    assert not state, sorted(state)[:4]
    return ref


@pytest.mark.parametrize("qtype", ["MXFP4_MOE", "Q8_0"])
def test_gguf_matches_transformers_on_its_weights(converted, qtype):
    hf, files = converted
    llm = quill.LLM(str(files[qtype]), skip_tokenizer_init=True, kv_cache_dtype="float32", activation_quant="none")
    specs = llm.model.decoder_layer_specs()
    assert [s.attention.window for s in specs] == [WINDOW, None, WINDOW, None]
    experts = [i for i in llm.loaded.layers if i.kind == "expert"]
    assert {i.bits for i in experts} == ({4} if qtype == "MXFP4_MOE" else {8})
    ids = torch.randint(4, GGUF_VOCAB, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = reference(hf, files[qtype])
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)
    want = want[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert (scored(llm, ids, 24) - want).abs().max() < 1e-3
