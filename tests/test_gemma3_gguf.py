"""Gemma 3 as GGUF files written by llama.cpp's own converter and quantizer (Q8_0, Q4_0), against transformers'
float32 forward on the same (dequantized) weights.  The converter stores every norm as 1 + w (undone on load)
and drops what llama.cpp assumes: the query scale (1 / sqrt(head_dim)) and which layers are local (each 6th is
global); the model here is made with those values.  The local layers' rope base it writes
(``gemma3.rope.freq_base_swa``)."""

from __future__ import annotations

import pytest
import torch

import quill
from quill.formats.gguf.checkpoint import GGUFCheckpoint
from tests.engine_util import scored
from tests.llamacpp_util import convert, quantize, save_smollm2_tokenizer
from tests.model_util import save_hf_dir
from tests.test_gemma3 import WINDOW, hf_gemma3

GGUF_VOCAB = 49152  # the SmolLM2 tokenizer the converter recognises
# what a GGUF file can say: the query scale is 1 / sqrt(head_dim), local layers every layer but each 6th
# (llama.cpp's defaults for what the converter does not write); rows of whole Q4_0 blocks
GGUF_TEXT = dict(vocab_size=GGUF_VOCAB, num_hidden_layers=6, hidden_size=96, intermediate_size=160,
                 query_pre_attn_scalar=16, layer_types=None, sliding_window_pattern=6,
                 rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    hf = hf_gemma3(seed=4, **GGUF_TEXT)
    assert hf.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    d = save_hf_dir(hf, tmp_path_factory.mktemp("gemma3gguf") / "hf", tokenizer=False)
    save_smollm2_tokenizer(d)
    f32 = convert(d, d / "f32.gguf", "f32")
    return hf, {q: quantize(f32, d / f"{q}.gguf", q) for q in ("Q8_0", "Q4_0")}


def reference(hf, path):
    """``hf`` with the GGUF file's weights, dequantized, in transformers' names (norms back to w)."""
    ckpt = GGUFCheckpoint(path)
    state = {f"{m}.weight": qw.dequantize() for m, qw in ckpt.quantized_layers()}
    state.update({k: t.float() for k, t in ckpt.dense_tensors()})
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(state, strict=True)
    return ref


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_gguf_matches_transformers_on_its_weights(converted, qtype):
    hf, files = converted
    llm = quill.LLM(str(files[qtype]), skip_tokenizer_init=True, kv_cache_dtype="float32", activation_quant="none")
    assert [s.attention.window for s in llm.model.decoder_layer_specs()] == [WINDOW] * 5 + [None]
    ids = torch.randint(4, GGUF_VOCAB, (1, 60), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = torch.log_softmax(reference(hf, files[qtype])(ids).logits.float(), -1)[0]
    got = scored(llm, ids[0].tolist(), 24, block_size=8)
    ref = want[:-1].gather(1, ids[0, 1:, None])[:, 0]
    assert (got - ref).abs().max() < 1e-3
