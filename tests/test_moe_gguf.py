"""GGUF MoE files (stacked 3-D expert tensors, as llama.cpp writes them) run through the same MoE path.

Tiny transformers MoE models are written to GGUF with the ``gguf`` package (experts Q4_0 /
Q4_1 / Q8_0, attention Q8_0); the transformers twin gets the gguf package's own
quantize-dequantize of every weight, so quill must match it to float32 rounding.
"""

import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from quill.formats.checkpoint import open_checkpoint
from quill.layers import SparseMoeBlock
from quill.models.base import ForwardContext
from tests.gguf_util import T, V, llama_permute, write_gguf
from tests.moe_models_util import hf_moe_model
from tests.test_moe_models import TOL, hf_logits, ids_of, load

ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
# llama.cpp's MoE files are sparse in every layer; GGUF blocks need inputs in multiples of 32
ALL_SPARSE = {"qwen3_moe": dict(decoder_sparse_step=1, mlp_only_layers=[]),
              "qwen2_moe": dict(mlp_only_layers=[], shared_expert_intermediate_size=64), "mixtral": {}}
EXPERT_TYPES = {"gate": T.Q4_0, "up": T.Q4_1, "down": T.Q8_0}
ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm"}


def _metadata(cfg, arch: str) -> list:
    a = arch
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    kv = [(f"{a}.block_count", cfg.num_hidden_layers, V.UINT32), (f"{a}.embedding_length", cfg.hidden_size, V.UINT32),
          (f"{a}.context_length", cfg.max_position_embeddings, V.UINT32),
          (f"{a}.feed_forward_length", cfg.intermediate_size, V.UINT32),
          (f"{a}.attention.head_count", cfg.num_attention_heads, V.UINT32),
          (f"{a}.attention.head_count_kv", cfg.num_key_value_heads, V.UINT32),
          (f"{a}.attention.key_length", getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
           V.UINT32),
          (f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps, V.FLOAT32),
          (f"{a}.rope.freq_base", float(cfg.rope_parameters["rope_theta"]), V.FLOAT32),
          (f"{a}.vocab_size", cfg.vocab_size, V.UINT32),
          (f"{a}.expert_count", experts, V.UINT32), (f"{a}.expert_used_count", cfg.num_experts_per_tok, V.UINT32)]
    if arch != "llama":
        kv.append((f"{a}.expert_feed_forward_length", cfg.moe_intermediate_size, V.UINT32))
    if arch == "qwen2moe":
        kv.append((f"{a}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size, V.UINT32))
    return kv


def to_gguf(hf, model_type: str, path, every_type=None):
    """Write ``hf`` as llama.cpp would; return the path and the twin's state (gguf round trips).

    ``every_type`` (e.g. F16): every matrix in that type instead (a source for llama.cpp's quantizer)."""
    arch, cfg = ARCH[model_type], hf.config
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    tensors, twin = [], {}

    def put(gguf_name: str, hf_name: str, w: np.ndarray, qtype, permute_heads: int | None = None):
        if every_type is not None and w.ndim >= 2:
            qtype = every_type
        stored = llama_permute(w, permute_heads) if permute_heads else w
        tensors.append((gguf_name, stored, qtype))
        back = w if qtype == T.F32 else _roundtrip(w, qtype)
        twin[hf_name] = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32)).reshape(sd[hf_name].shape)

    put("token_embd.weight", "model.embed_tokens.weight", sd["model.embed_tokens.weight"], T.F32)
    put("output_norm.weight", "model.norm.weight", sd["model.norm.weight"], T.F32)
    if not cfg.tie_word_embeddings:
        put("output.weight", "lm_head.weight", sd["lm_head.weight"], T.Q8_0)
    for li in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{li}", f"blk.{li}"
        for hf_n, g_n in NORMS.items():
            if f"{p}.{hf_n}.weight" in sd:
                put(f"{b}.{g_n}.weight", f"{p}.{hf_n}.weight", sd[f"{p}.{hf_n}.weight"], T.F32)
        for proj, g_n in ATTN.items():
            heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(proj)
            perm = heads if arch == "llama" else None
            put(f"{b}.{g_n}.weight", f"{p}.self_attn.{proj}.weight", sd[f"{p}.self_attn.{proj}.weight"], T.Q8_0,
                perm)
            if f"{p}.self_attn.{proj}.bias" in sd:
                put(f"{b}.{g_n}.bias", f"{p}.self_attn.{proj}.bias", sd[f"{p}.self_attn.{proj}.bias"], T.F32)
        put(f"{b}.ffn_gate_inp.weight", f"{p}.mlp.gate.weight", sd[f"{p}.mlp.gate.weight"], T.F32)
        gate_up, down = sd[f"{p}.mlp.experts.gate_up_proj"], sd[f"{p}.mlp.experts.down_proj"]  # [E, 2I, H], [E, H, I]
        inter = gate_up.shape[1] // 2
        for name, w in (("gate", gate_up[:, :inter]), ("up", gate_up[:, inter:]), ("down", down)):
            tensors.append((f"{b}.ffn_{name}_exps.weight", np.ascontiguousarray(w), every_type or EXPERT_TYPES[name]))
        twin[f"{p}.mlp.experts.gate_up_proj"] = torch.from_numpy(np.concatenate(
            [_roundtrip(gate_up[:, :inter], T.Q4_0), _roundtrip(gate_up[:, inter:], T.Q4_1)], axis=1))
        twin[f"{p}.mlp.experts.down_proj"] = torch.from_numpy(_roundtrip(down, T.Q8_0))
        if f"{p}.mlp.shared_expert_gate.weight" in sd:
            for name in ("gate", "up", "down"):
                key = f"{p}.mlp.shared_expert.{name}_proj.weight"
                put(f"{b}.ffn_{name}_shexp.weight", key, sd[key], T.Q4_1)
            put(f"{b}.ffn_gate_inp_shexp.weight", f"{p}.mlp.shared_expert_gate.weight",
                sd[f"{p}.mlp.shared_expert_gate.weight"][0], T.F32)
    return write_gguf(path, arch, _metadata(cfg, arch), tensors), twin


def _roundtrip(w: np.ndarray, qtype) -> np.ndarray:
    if qtype == T.F16:
        return w.astype(np.float16).astype(np.float32)
    return dequantize(quantize(np.ascontiguousarray(w), qtype), qtype).astype(np.float32).reshape(w.shape)


@pytest.mark.parametrize("model_type", sorted(ARCH))
def test_gguf_moe_matches_transformers(model_type, tmp_path):
    hf = hf_moe_model(model_type, seed=20, **ALL_SPARSE[model_type])
    path, twin = to_gguf(hf, model_type, tmp_path / "m.gguf")
    missing, unexpected = hf.load_state_dict(twin, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    loaded = load(open_checkpoint(path), "reference", "grouped")
    blocks = [m for m in loaded.model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == hf.config.num_hidden_layers
    assert not blocks[0].fused.config.uniform and blocks[0].fused.config.has_offsets  # Q4_1's min
    experts = {i.summary.rsplit(" ", 1)[0] for i in loaded.layers if i.kind == "expert"}
    assert experts == {"W4A16 g32 sym", "W4A16 g32 offset", "W8A16 ch sym"}  # down: in 32 = one group
    ids = ids_of(9, batch=2, seed=21)
    torch.testing.assert_close(loaded.model(ids, ForwardContext.causal(2, 9)), hf_logits(hf, ids), **TOL)
