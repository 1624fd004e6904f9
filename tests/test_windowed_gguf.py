"""quill.bench.windowed_gguf writes what llama.cpp's tools write: the Gemma 3 F16 file its converter writes for a
transformers model of the same configuration, the gpt-oss file its MXFP4_MOE quantizer makes of the converted
one (metadata keys in order, value types and values, the tokenizer's aside: the writer copies the default
model's; tensor names, order, ggml types and shapes); the random blocks decode to sane values; the full-size
shapes have the published models' sizes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from quill.bench import windowed_gguf as wg
from quill.formats.gguf.file import GGUFFile
from tests.llamacpp_util import convert, quantize, save_smollm2_tokenizer
from tests.model_util import save_hf_dir

VOCAB = 49152  # the SmolLM2 tokenizer the converter recognises
GEMMA3 = replace(wg.TINY["gemma3"], vocab=VOCAB)
GPT_OSS = replace(wg.TINY["gpt-oss"], vocab=VOCAB)


def gemma3_checkpoint():
    from tests.gemma3_util import hf_gemma3

    s = GEMMA3
    return hf_gemma3(seed=0, vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.ffn,
                     num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                     head_dim=s.head_dim, query_pre_attn_scalar=s.head_dim, max_position_embeddings=s.context,
                     sliding_window=s.window, final_logit_softcapping=None, layer_types=None,
                     sliding_window_pattern=6, rms_norm_eps=s.eps,
                     rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": s.rope_theta},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": s.rope_local}})


def gpt_oss_checkpoint():
    from tests.gpt_oss_util import hf_gpt_oss

    s = GPT_OSS
    rope = {"rope_type": "yarn", "factor": s.yarn_factor, "beta_fast": s.yarn_beta_fast, "beta_slow": s.yarn_beta_slow,
            "truncate": False, "original_max_position_embeddings": s.yarn_original_context, "rope_theta": s.rope_theta}
    return hf_gpt_oss(seed=0, vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.expert_ffn,
                      num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                      head_dim=s.head_dim, num_local_experts=s.experts, num_experts_per_tok=s.experts_used,
                      sliding_window=s.window, max_position_embeddings=s.context, rms_norm_eps=s.eps,
                      rope_parameters=rope)


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    """{"gemma3": the converter's F16 file, "gpt-oss": its F16 file quantized to MXFP4_MOE by llama.cpp}."""
    out = {}
    for name, make in (("gemma3", gemma3_checkpoint), ("gpt-oss", gpt_oss_checkpoint)):
        d = tmp_path_factory.mktemp(name) / "hf"
        save_hf_dir(make(), d, tokenizer=False)
        save_smollm2_tokenizer(d)
        out[name] = convert(d, d.parent / "f16.gguf", "f16")
    out["gpt-oss"] = quantize(out["gpt-oss"], out["gpt-oss"].parent / "mxfp4_moe.gguf", "MXFP4_MOE")
    return out


def layout(path):
    f = GGUFFile(path)
    meta = [(k, f.value_types[k], v) for k, v in f.metadata.items() if not k.startswith("tokenizer.")
            and k != "general.name"]
    return meta, [(i.name, i.ggml_type, i.shape) for i in f.tensors.values()]


def test_gemma3_writer_matches_the_converter(tools, tmp_path):
    from quill.engine.hub import default_model

    got = wg.write_gemma3_gguf(tmp_path, GEMMA3, default_model())
    assert layout(got) == layout(tools["gemma3"])


def test_gpt_oss_writer_matches_the_mxfp4_moe_quantizer(tools, tmp_path):
    from quill.engine.hub import default_model

    got = wg.write_gpt_oss_gguf(tmp_path, GPT_OSS, default_model())
    assert layout(got) == layout(tools["gpt-oss"])
    keys = list(GGUFFile(got).metadata)
    assert keys[-2:] == ["general.quantization_version", "general.file_type"]  # after the tokenizer, as quantized


def test_random_blocks_decode_to_sane_values():
    """MXFP4: E8M0 exponents around the one giving 1 / sqrt(fan-in); Q8_0: codes in [-127, 127] (ggml's rounding
    never gives -128), one f16 scale; both decode (gguf-py) to that standard deviation within 2x."""
    import gguf

    rng = np.random.default_rng(0)
    for kind, make in ((gguf.GGMLQuantizationType.MXFP4, wg.mxfp4_blocks), (gguf.GGMLQuantizationType.Q8_0,
                                                                             wg.q8_0_blocks)):
        for cols in (256, 2880):
            blocks = make(rng, (4, 64, cols), cols ** -0.5)
            w = gguf.quants.dequantize(blocks, kind)
            assert w.shape == (4, 64, cols) and np.isfinite(w).all()
            assert 0.5 < w.std() * cols ** 0.5 < 2.0
    q8 = wg.q8_0_blocks(rng, (512, 256), 0.1).reshape(512, 8, 34)
    assert q8[..., 2:].view(np.int8).min() == -127 and q8[..., 2:].view(np.int8).max() == 127


def test_full_size_shapes():
    gemma, oss = (wg.weight_counts(wg.SHAPES[m]) for m in ("gemma3", "gpt-oss"))
    assert 0.99e9 < gemma["weights"] == gemma["weights_per_token"] < 1.01e9  # tied: the embedding is the lm_head
    assert 20.8e9 < oss["weights"] < 21.0e9 and 3.5e9 < oss["weights_per_token"] < 3.7e9
    size = sum(t.nbytes() for t in wg.gpt_oss_specs(wg.SHAPES["gpt-oss"]))
    assert 11.5e9 < size < 12.5e9
    for s in (wg.SHAPES["gemma3"], wg.TINY["gemma3"]):
        assert s.layers > 6  # a global layer (each 6th) and local ones after it
