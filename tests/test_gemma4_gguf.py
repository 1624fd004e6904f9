"""Gemma 4 as GGUF files written by llama.cpp's own converter and quantizer (Q8_0, Q4_0, Q4_K_M), against
transformers' float32 forward on the same (dequantized) weights.  The converter keeps the norms as they are
(Gemma 4's are plain ``x_hat * w``), writes which layers are local as one flag per layer, the KV head count
and MLP width per layer, the two head sizes, and the global layers' proportional rope as a ``rope_freqs``
tensor; it needs a Llama-style BPE tokenizer with byte fallback (Gemma 4's kind), made here."""

from __future__ import annotations

import json

import pytest
import torch

import quill
from quill.formats.gguf.checkpoint import GGUFCheckpoint
from tests.engine_util import scored
from tests.llamacpp_util import convert, quantize
from tests.model_util import save_hf_dir
from tests.test_gemma4 import WINDOW, G, L, hf_gemma4

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
PIECES = ["\u2581", *LETTERS, "\u2581t", "he", "\u2581the", "in", "\u2581a"]
GGUF_VOCAB = len(SPECIALS) + 256 + len(PIECES)  # 292
# rows of whole 32-blocks (Q4_0, Q8_0); layers 4 and 5 KV-shared; global heads 64 wide, values from the keys
GGUF_TEXT = dict(vocab_size=GGUF_VOCAB, vocab_size_per_layer_input=GGUF_VOCAB, hidden_size=96, intermediate_size=160,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
                 num_global_key_value_heads=1, hidden_size_per_layer_input=32, layer_types=[L, L, G, L, L, G],
                 num_kv_shared_layers=2, bos_token_id=2, eos_token_id=1, pad_token_id=0)


def save_byte_fallback_tokenizer(directory):
    """A SentencePiece-style BPE tokenizer with byte fallback in tokenizer.json (what llama.cpp's Gemma 4
    converter reads, through gguf-py's LlamaHfVocab)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {t: i for i, t in enumerate([*SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), *PIECES])}
    merges = [("\u2581", "t"), ("h", "e"), ("\u2581t", "he"), ("i", "n"), ("\u2581", "a")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(SPECIALS)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
         "pad_token": "<pad>", "unk_token": "<unk>"}))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    hf = hf_gemma4(seed=4, **GGUF_TEXT)
    d = save_hf_dir(hf, tmp_path_factory.mktemp("gemma4gguf") / "hf", tokenizer=False)
    save_byte_fallback_tokenizer(d)
    f32 = convert(d, d / "f32.gguf", "f32")
    return hf, {q: quantize(f32, d / f"{q}.gguf", q) for q in ("Q8_0", "Q4_0", "Q4_K_M")}


def reference(hf, path):
    """``hf`` with the GGUF file's weights, dequantized, in transformers' names."""
    ckpt = GGUFCheckpoint(path)
    state = {f"{m}.weight": qw.dequantize() for m, qw in ckpt.quantized_layers()}
    state.update({k: t.float() for k, t in ckpt.dense_tensors()})
    state = {k.replace("layer_scalar.weight", "layer_scalar"): v for k, v in state.items()}
    state["model.embed_tokens_per_layer.weight"] = state["model.embed_tokens_per_layer.weight"].float()
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(state, strict=True)
    return ref


def test_the_file_says_what_the_config_said(converted):
    hf, files = converted
    cfg = GGUFCheckpoint(files["Q8_0"]).config
    c = hf.config
    assert cfg["layer_types"] == c.layer_types and cfg["num_kv_shared_layers"] == 2
    assert (cfg["head_dim"], cfg["global_head_dim"]) == (32, 64)
    assert (cfg["num_key_value_heads"], cfg["num_global_key_value_heads"], cfg["attention_k_eq_v"]) == (2, 1, True)
    assert cfg["rope_parameters"][G]["partial_rotary_factor"] == 0.25
    assert cfg["hidden_size_per_layer_input"] == 32 and cfg["sliding_window"] == WINDOW


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K_M"])
def test_gguf_matches_transformers_on_its_weights(converted, qtype):
    hf, files = converted
    llm = quill.LLM(str(files[qtype]), skip_tokenizer_init=True, kv_cache_dtype="float32", activation_quant="exact")
    assert [s.attention.window for s in llm.model.decoder_layer_specs()] == [WINDOW, WINDOW, None] * 2
    ids = torch.randint(4, GGUF_VOCAB, (1, 60), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = torch.log_softmax(reference(hf, files[qtype])(ids).logits.float(), -1)[0]
    got = scored(llm, ids[0].tolist(), 24, block_size=8)
    ref = want[:-1].gather(1, ids[0, 1:, None])[:, 0]
    assert (got - ref).abs().max() < 1e-3


def test_the_files_gemma4_tokenizer_encodes_as_the_hf_one(converted):
    """llama.cpp's ``gemma4`` tokenizer model (the merges, U+2581 for spaces, byte fallback): the HF tokenizer's
    ids for text with merges, newlines, specials and characters only bytes spell."""
    from transformers import AutoTokenizer

    from quill.tokenizer import Tokenizer
    _, files = converted
    spec = GGUFCheckpoint(files["Q8_0"]).tokenizer_spec()
    hf = AutoTokenizer.from_pretrained(files["Q8_0"].parent)
    ours = Tokenizer(spec)
    assert spec.add_bos_token and spec.bos_token_id == 2
    for text in ("the theme in a hat", "a\n\nthe end ü", " leading space<eos>", "ÿ€ then"):
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), text
        assert ours.decode(hf.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


def moe_gguf(d):
    """The MoE variant (3 layers, 4 experts of which 2 per token, random router and per-expert scales) saved in
    ``d`` with its tokenizer, converted and quantized to Q8_0 by llama.cpp: (the transformers model, the file)."""
    hf = hf_gemma4(seed=6, **{**GGUF_TEXT, "num_hidden_layers": 3, "layer_types": [L, G, G],
                              "num_kv_shared_layers": 1}, enable_moe_block=True, num_experts=4, top_k_experts=2,
                   moe_intermediate_size=32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("router.scale", "per_expert_scale")):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    save_hf_dir(hf, d, tokenizer=False)
    save_byte_fallback_tokenizer(d)
    return hf, quantize(convert(d, d / "f32.gguf", "f32"), d / "q8.gguf", "Q8_0")


def test_the_moe_variant_from_gguf(tmp_path):
    """enable_moe_block through the converter (gate and up stacked as ffn_gate_up_exps, the router's scale and
    the per-expert scales as .scale vectors) and Q8_0, against transformers on the file's weights."""
    hf, path = moe_gguf(tmp_path / "hf")
    cfg = GGUFCheckpoint(path).config
    assert cfg["enable_moe_block"] and (cfg["num_experts"], cfg["top_k_experts"]) == (4, 2)
    llm = quill.LLM(str(path), skip_tokenizer_init=True, kv_cache_dtype="float32", activation_quant="none")
    ids = torch.randint(4, GGUF_VOCAB, (1, 50), generator=torch.Generator().manual_seed(3))
    state_ref = reference_moe(hf, path)
    with torch.no_grad():
        want = torch.log_softmax(state_ref(ids).logits.float(), -1)[0]
    got = scored(llm, ids[0].tolist(), 24, block_size=8)
    assert (got - want[:-1].gather(1, ids[0, 1:, None])[:, 0]).abs().max() < 1e-3


def reference_moe(hf, path):
    """``hf`` (MoE) with the file's weights: the experts put back into transformers' stacked tensors."""
    ckpt = GGUFCheckpoint(path)
    state = {f"{m}.weight": qw.dequantize() for m, qw in ckpt.quantized_layers()}
    state.update({k: t.float() for k, t in ckpt.dense_tensors()})
    out = {}
    for k, v in state.items():
        k = k.replace("layer_scalar.weight", "layer_scalar").replace(".moe.gate.", ".router.proj.")
        k = k.replace(".moe.router_scale.weight", ".router.scale").replace(
            ".moe.per_expert_scale.weight", ".router.per_expert_scale")
        out[k] = v
    E = hf.config.num_experts
    for i in range(hf.config.num_hidden_layers):
        p = f"model.layers.{i}"
        gu = out.pop(f"{p}.moe.stacked.gate_up_proj.weight", None)
        if gu is None:
            gu = out.pop(f"{p}.moe.stacked.gate_up_proj")
        out[f"{p}.experts.gate_up_proj"] = gu.reshape(E, -1, gu.shape[-1])
        out[f"{p}.experts.down_proj"] = torch.stack([out.pop(f"{p}.moe.experts.{e}.down_proj.weight")
                                                     for e in range(E)])
    out["model.embed_tokens_per_layer.weight"] = out["model.embed_tokens_per_layer.weight"].float()
    out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(out, strict=True)
    return ref
