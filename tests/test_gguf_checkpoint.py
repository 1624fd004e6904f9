"""GGUF blocks -> canonical weights, bit for bit against gguf-py; names, q/k order, experts, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from gguf_util import T, V, llama_permute, write_gguf

from quill.errors import ConfigError, UnsupportedFormatError
from quill.formats.checkpoint import open_checkpoint
from quill.formats.gguf.checkpoint import GGUFCheckpoint
from quill.formats.gguf.file import GGML_TYPES
from quill.formats.gguf.quants import block_weight


def bits(t) -> torch.Tensor:
    """float32 values as their bit patterns, so -0.0 != 0.0 and NaN payloads count."""
    return torch.as_tensor(np.ascontiguousarray(t, dtype=np.float32)).view(torch.int32)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0])
def test_random_blocks_dequantize_like_gguf_py(qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 48, 32 * 7
    data = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 10, (rows, 1)).astype(np.float32)
    data[0] = 0.0  # all-zero blocks: scale 0
    data[1, :32] = -3.0  # a constant block
    packed = quantize(data, qtype)  # uint8 [rows, row_bytes], gguf-py's own quantizer
    qw = block_weight(torch.from_numpy(packed), int(qtype), "w").validate()
    assert qw.codes.shape == (rows, cols) and qw.group_size == 32
    assert torch.equal(bits(qw.dequantize()), bits(dequantize(packed, qtype)))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0])
def test_arbitrary_block_bytes_dequantize_like_gguf_py(qtype):
    """Random bytes exercise every code and nibble position; scales are finite random f16."""
    rng = np.random.default_rng(100 + int(qtype))
    n_scale = 4 if qtype == T.Q4_1 else 2
    block_bytes = {T.Q4_0: 18, T.Q4_1: 20, T.Q8_0: 34}[qtype]
    raw = rng.integers(0, 256, (16, 6, block_bytes), dtype=np.uint8)
    halves = rng.standard_normal((16, 6, n_scale // 2)).astype(np.float16)
    raw[..., :n_scale] = halves.view(np.uint8).reshape(16, 6, n_scale)
    raw = raw.reshape(16, -1)
    qw = block_weight(torch.from_numpy(raw), int(qtype), "w").validate()
    assert torch.equal(bits(qw.dequantize()), bits(dequantize(raw, qtype)))


def test_canonical_layout_facts():
    """Q4_1 keeps d/m as scales/offsets with zero points 0; Q8_0 codes are the int8 values + 128."""
    data = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
    q41 = block_weight(torch.from_numpy(quantize(data, T.Q4_1)), int(T.Q4_1), "w")
    assert q41.bits == 4 and q41.scales.dtype == torch.float16 and q41.offsets.dtype == torch.float16
    assert q41.zeros is not None and not q41.zeros.any()
    packed = quantize(data, T.Q8_0)
    q8 = block_weight(torch.from_numpy(packed), int(T.Q8_0), "w")
    int8 = packed.reshape(2, 34)[:, 2:].view(np.int8).astype(np.int16).reshape(1, 64) + 128
    assert q8.bits == 8 and q8.symmetric and torch.equal(q8.codes.to(torch.int16), torch.from_numpy(int8))


# ---- whole files: names, q/k permutation, experts, dense tensors ------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 4, 2, 16, 96, 40


def _arch_kv(arch: str, experts: int = 0):
    kv = [(f"{arch}.block_count", 1, V.UINT32), (f"{arch}.embedding_length", HIDDEN, V.UINT32),
          (f"{arch}.context_length", 256, V.UINT32), (f"{arch}.feed_forward_length", FFN, V.UINT32),
          (f"{arch}.attention.head_count", HEADS, V.UINT32), (f"{arch}.attention.head_count_kv", KV_HEADS, V.UINT32),
          (f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, V.FLOAT32), (f"{arch}.rope.freq_base", 5e5, V.FLOAT32),
          (f"{arch}.vocab_size", VOCAB, V.UINT32)]
    if experts:
        kv += [(f"{arch}.expert_count", experts, V.UINT32), (f"{arch}.expert_used_count", 2, V.UINT32),
               (f"{arch}.expert_feed_forward_length", FFN, V.UINT32)]
    return kv


def _hf_attention(rng, with_bias: bool):
    """HF-order q/k/v/o weights (and q/k/v biases)."""
    w = {"q": rng.standard_normal((HEADS * HEAD_DIM, HIDDEN)), "k": rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)),
         "v": rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)), "output": rng.standard_normal((HIDDEN, HIDDEN))}
    b = {k: rng.standard_normal(w[k].shape[0]) for k in "qkv"} if with_bias else {}
    return {k: v.astype(np.float32) for k, v in w.items()}, {k: v.astype(np.float32) for k, v in b.items()}


def _roundtrip(w: np.ndarray, qtype) -> torch.Tensor:
    return torch.from_numpy(dequantize(quantize(w, qtype), qtype).astype(np.float32))


def _read_all(path):
    ckpt = open_checkpoint(path)
    quant = {n: qw for n, qw in ckpt.quantized_layers()}
    dense = dict(ckpt.dense_tensors())
    return ckpt, quant, dense


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0])
def test_llama_qk_rows_come_back_in_hf_order(tmp_path, qtype):
    """llama.cpp permutes q/k rows before quantizing; row-wise block quantization commutes with a row
    permutation, so reading the file must give exactly quantize-dequantize of the HF-order weight."""
    rng = np.random.default_rng(3)
    w, b = _hf_attention(rng, with_bias=True)
    perm = {"q": HEADS, "k": KV_HEADS}
    tensors = []
    for k, mat in w.items():
        tensors.append((f"blk.0.attn_{k}.weight", llama_permute(mat, perm[k]) if k in perm else mat, qtype))
    for k, vec in b.items():
        tensors.append((f"blk.0.attn_{k}.bias", llama_permute(vec, perm[k]) if k in perm else vec, T.F32))
    path = write_gguf(tmp_path / "l.gguf", "llama", _arch_kv("llama"), tensors)
    ckpt, quant, dense = _read_all(path)
    assert isinstance(ckpt, GGUFCheckpoint) and dense == {}
    for k, name in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")):
        qw = quant[f"model.layers.0.self_attn.{name}"]
        assert torch.equal(bits(qw.dequantize()), bits(_roundtrip(w[k], qtype))), name
        if k in b:
            assert torch.equal(qw.bias, torch.from_numpy(b[k])), name
    assert ckpt.plan["model.layers.0.self_attn.q_proj"] == ["weight", "bias"]
    assert ckpt.config["attention_bias"] is True


@pytest.mark.parametrize("qtype, dtype", [(T.F32, torch.float32), (T.F16, torch.float16), (T.BF16, torch.bfloat16)])
def test_dense_linears_stay_dense_in_hf_order(tmp_path, qtype, dtype):
    rng = np.random.default_rng(4)
    w, b = _hf_attention(rng, with_bias=True)
    tensors = [("blk.0.attn_q.weight", llama_permute(w["q"], HEADS), qtype),
               ("blk.0.attn_k.weight", llama_permute(w["k"], KV_HEADS), qtype),
               ("blk.0.attn_k.bias", llama_permute(b["k"], KV_HEADS), T.F32),
               ("blk.0.attn_v.weight", w["v"], qtype)]
    _, quant, dense = _read_all(write_gguf(tmp_path / "d.gguf", "llama", _arch_kv("llama"), tensors))
    assert quant == {}
    for k, name in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
        t = dense[f"model.layers.0.self_attn.{name}.weight"]
        assert t.dtype == dtype and torch.equal(t.float(), _roundtrip(w[k], qtype))
    assert torch.equal(dense["model.layers.0.self_attn.k_proj.bias"], torch.from_numpy(b["k"]))


def test_qwen2_is_not_permuted_and_names_every_tensor(tmp_path):
    rng = np.random.default_rng(5)
    w, b = _hf_attention(rng, with_bias=True)
    ffn = {n: rng.standard_normal(s).astype(np.float32) for n, s in
           (("gate", (FFN, HIDDEN)), ("up", (FFN, HIDDEN)), ("down", (HIDDEN, FFN)))}
    norms = {n: rng.standard_normal(HIDDEN).astype(np.float32) for n in ("attn_norm", "ffn_norm", "output_norm")}
    tensors = [(f"blk.0.attn_{k}.weight", m, T.Q8_0) for k, m in w.items()]
    tensors += [(f"blk.0.attn_{k}.bias", v, T.F32) for k, v in b.items()]
    tensors += [(f"blk.0.ffn_{k}.weight", m, T.Q4_0) for k, m in ffn.items()]
    tensors += [(f"blk.0.{n}.weight", v, T.F32) for n, v in norms.items() if n != "output_norm"]
    tensors += [("output_norm.weight", norms["output_norm"], T.F32),
                ("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), T.F16),
                ("output.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), T.Q8_0)]
    ckpt, quant, dense = _read_all(write_gguf(tmp_path / "q.gguf", "qwen2", _arch_kv("qwen2"), tensors))
    assert torch.equal(quant["model.layers.0.self_attn.q_proj"].dequantize(), _roundtrip(w["q"], T.Q8_0))
    assert torch.equal(quant["model.layers.0.mlp.down_proj"].dequantize(), _roundtrip(ffn["down"], T.Q4_0))
    assert sorted(quant) == sorted(["lm_head"] + [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")]
                                   + [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"])
    assert sorted(dense) == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                             "model.layers.0.post_attention_layernorm.weight", "model.norm.weight"]
    assert torch.equal(dense["model.norm.weight"], torch.from_numpy(norms["output_norm"]))
    cfg = ckpt.config
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["tie_word_embeddings"] is False and cfg["torch_dtype"] == "float16"
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == \
        (HIDDEN, HEADS, KV_HEADS, HIDDEN // HEADS)
    assert cfg["rope_theta"] == 5e5 and cfg["intermediate_size"] == FFN and cfg["vocab_size"] == VOCAB
    assert ckpt.quant_method == "gguf" and "Q8_0 x" in ckpt.describe()


@pytest.mark.parametrize("arch, moe_prefix, model_type", [("qwen3moe", "mlp", "qwen3_moe"),
                                                          ("llama", "block_sparse_moe", "mixtral")])
def test_stacked_experts_become_one_module_per_expert(tmp_path, arch, moe_prefix, model_type):
    rng = np.random.default_rng(6)
    n_exp = 3
    exps = {p: rng.standard_normal((n_exp, FFN, HIDDEN) if p != "down" else (n_exp, HIDDEN, FFN)).astype(np.float32)
            for p in ("gate", "up", "down")}
    router = rng.standard_normal((n_exp, HIDDEN)).astype(np.float32)
    tensors = [(f"blk.0.ffn_{p}_exps.weight", m, T.Q8_0 if p != "down" else T.F16) for p, m in exps.items()]
    tensors.append(("blk.0.ffn_gate_inp.weight", router, T.F32))
    if arch == "qwen3moe":
        tensors.append(("blk.0.attn_q_norm.weight", rng.standard_normal(HEAD_DIM).astype(np.float32), T.F32))
    ckpt, quant, dense = _read_all(write_gguf(tmp_path / "m.gguf", arch, _arch_kv(arch, n_exp), tensors))
    for e in range(n_exp):
        base = f"model.layers.0.{moe_prefix}.experts.{e}"
        for p in ("gate", "up"):
            assert torch.equal(quant[f"{base}.{p}_proj"].dequantize(), _roundtrip(exps[p][e], T.Q8_0)), (e, p)
        assert torch.equal(dense[f"{base}.down_proj.weight"].float(), _roundtrip(exps["down"][e], T.F16))
    assert torch.equal(dense[f"model.layers.0.{moe_prefix}.gate.weight"], torch.from_numpy(router))
    cfg = ckpt.config
    assert cfg["model_type"] == model_type and cfg["num_experts_per_tok"] == 2
    assert cfg.get("num_experts", cfg.get("num_local_experts")) == n_exp
    if arch == "qwen3moe":
        assert "model.layers.0.self_attn.q_norm.weight" in dense
        assert cfg["moe_intermediate_size"] == FFN and cfg["norm_topk_prob"] is True


def test_qwen2moe_shared_expert_and_legacy_mixtral_experts(tmp_path):
    rng = np.random.default_rng(8)
    shexp = {p: rng.standard_normal((FFN, HIDDEN) if p != "down" else (HIDDEN, FFN)).astype(np.float32)
             for p in ("gate", "up", "down")}
    gate_vec = rng.standard_normal(HIDDEN).astype(np.float32)
    tensors = [(f"blk.0.ffn_{p}_shexp.weight", m, T.Q4_1) for p, m in shexp.items()]
    tensors.append(("blk.0.ffn_gate_inp_shexp.weight", gate_vec, T.F32))
    kv = _arch_kv("qwen2moe", 4) + [("qwen2moe.expert_shared_feed_forward_length", FFN, V.UINT32)]
    ckpt, quant, dense = _read_all(write_gguf(tmp_path / "q2.gguf", "qwen2moe", kv, tensors))
    for p, m in shexp.items():
        assert torch.equal(quant[f"model.layers.0.mlp.shared_expert.{p}_proj"].dequantize(), _roundtrip(m, T.Q4_1))
    gate = dense["model.layers.0.mlp.shared_expert_gate.weight"]  # HF Linear(hidden, 1): [1, hidden]
    assert gate.shape == (1, HIDDEN) and torch.equal(gate[0], torch.from_numpy(gate_vec))
    assert ckpt.config["model_type"] == "qwen2_moe" and ckpt.config["shared_expert_intermediate_size"] == FFN
    assert ckpt.config["norm_topk_prob"] is False

    w1 = rng.standard_normal((FFN, HIDDEN)).astype(np.float32)  # pre-2024 Mixtral files: one tensor per expert
    path = write_gguf(tmp_path / "mx.gguf", "llama", _arch_kv("llama", 2), [("blk.0.ffn_gate.1.weight", w1, T.Q8_0)])
    _, quant, _ = _read_all(path)
    assert list(quant) == ["model.layers.0.block_sparse_moe.experts.1.gate_proj"]
    assert torch.equal(quant["model.layers.0.block_sparse_moe.experts.1.gate_proj"].dequantize(),
                       _roundtrip(w1, T.Q8_0))


def test_rope_scaling_rope_freqs_and_missing_config(tmp_path):
    kv = _arch_kv("llama") + [("llama.rope.scaling.type", "linear", V.STRING),
                              ("llama.rope.scaling.factor", 4.0, V.FLOAT32),
                              ("llama.rope.scaling.original_context_length", 2048, V.UINT32)]
    freqs = np.linspace(1, 8, HEAD_DIM // 2, dtype=np.float32)
    ckpt, _, dense = _read_all(write_gguf(tmp_path / "r.gguf", "llama", kv, [("rope_freqs.weight", freqs, T.F32)]))
    assert ckpt.config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0,
                                           "original_max_position_embeddings": 2048}
    assert torch.equal(dense["model.rotary_emb.freq_factors"], torch.from_numpy(freqs))
    kv = [k for k in _arch_kv("llama") if k[0] != "llama.embedding_length"]
    with pytest.raises(ConfigError, match="'llama.embedding_length' is missing"):
        GGUFCheckpoint(write_gguf(tmp_path / "m.gguf", "llama", kv))


@pytest.mark.parametrize("qtype,nbytes", [(T.IQ4_XS, 136), (T.IQ2_XXS, 66), (T.TQ2_0, 66), (T.NVFP4, 36)])
def test_unsupported_tensor_type_names_tensor_and_supported_types(tmp_path, qtype, nbytes):
    data = np.random.default_rng(7).integers(0, 256, (4, nbytes * (256 // GGML_TYPES[qtype][1])), dtype=np.uint8)
    path = write_gguf(tmp_path / "k.gguf", "llama", _arch_kv("llama"), [("blk.0.ffn_up.weight", data, qtype)])
    with pytest.raises(UnsupportedFormatError, match=rf"'blk.0.ffn_up.weight' has ggml type {qtype.name}.*"
                                                     r"supported: Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, "
                                                     r"Q4_K, Q5_K, Q6_K, MXFP4, F32, F16, BF16"):
        GGUFCheckpoint(path)


def test_unknown_architecture_and_tensor_name(tmp_path):
    with pytest.raises(UnsupportedFormatError, match="architecture 'gpt2' is not supported; supported: .*llama"):
        GGUFCheckpoint(write_gguf(tmp_path / "a.gguf", "gpt2", _arch_kv("gpt2")))
    vec = np.zeros(HIDDEN, np.float32)
    path = write_gguf(tmp_path / "b.gguf", "llama", _arch_kv("llama"), [("blk.0.mystery.weight", vec, T.F32)])
    with pytest.raises(UnsupportedFormatError, match="'blk.0.mystery.weight' has no Hugging Face name"):
        GGUFCheckpoint(path)
