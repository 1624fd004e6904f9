"""Gemma 4 GGUF files (llama.cpp's ``gemma4`` architecture): the config llama.cpp's converter wrote as
metadata (conversion/gemma.py ``Gemma4Model``), read back into transformers' ``gemma4_text`` fields.

What the file says per layer: the KV head count (one value, or one per layer when global layers have their
own), the MLP width (one per layer when KV-shared layers' MLPs are doubled), which layers are local
(``sliding_window_pattern``, one flag per layer).  Head sizes are ``key_length`` (global) and
``key_length_swa`` (local).  Global layers' "proportional" rope is stored as ``rope_freqs``: frequency
divisors of 1 for the turned channel pairs and 1e30 for the others, read here into
``partial_rotary_factor``.  Values taken from the keys (``attention_k_eq_v``) show as global layers
without ``attn_v``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from quill.errors import ConfigError, UnsupportedFormatError

LOCAL, GLOBAL = "sliding_attention", "full_attention"
# blk.N.<leaf> -> HF module names (llama.cpp's GEMMA4 tensor names)
NAMES = (
    ("post_attention_norm", "post_attention_layernorm"), ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"), ("inp_gate", "per_layer_input_gate"),
    ("proj", "per_layer_projection"), ("post_norm", "post_per_layer_input_norm"),
    ("layer_output_scale", "layer_scalar"),
    # the MoE variant: the dense MLP's and the experts' own norms, the router, gate and up stacked in halves
    ("pre_ffw_norm_2", "pre_feedforward_layernorm_2"), ("post_ffw_norm_1", "post_feedforward_layernorm_1"),
    ("post_ffw_norm_2", "post_feedforward_layernorm_2"), ("ffn_gate_inp", "moe.gate"),
    ("ffn_gate_up_exps", "moe.stacked.gate_up_proj"),
)
# the router's input scale and the per-expert scales: vectors stored as "<tensor>.scale"
SCALES = {"ffn_gate_inp": "moe.router_scale", "ffn_down_exps": "moe.per_expert_scale"}


def scale_name(gguf_name: str) -> str | None:
    """The HF module of a ``blk.N.<leaf>.scale`` vector (its weight), or None."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "scale" and parts[2] in SCALES:
        return f"model.layers.{parts[1]}.{SCALES[parts[2]]}"
    return None
GLOBAL_NAMES = {"per_layer_token_embd": "model.embed_tokens_per_layer",
                "per_layer_model_proj": "model.per_layer_model_projection",
                "per_layer_proj_norm": "model.per_layer_projection_norm"}
# per-layer arrays build_config's common part must see as one value (the first layer's); read here per layer
PER_LAYER_KEYS = ("attention.head_count_kv", "feed_forward_length")


def uniform_view(meta: dict, a: str) -> dict:
    """``meta`` with Gemma 4's per-layer arrays as their first value, for the keys every architecture reads."""
    out = dict(meta)
    for key in PER_LAYER_KEYS:
        v = meta.get(f"{a}.{key}")
        if isinstance(v, list) and v:
            out[f"{a}.{key}"] = v[0]
    return out


def _per_layer(meta: dict, key: str, n: int, path) -> list[int]:
    v = meta.get(key)
    if isinstance(v, list):
        if len(v) != n or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise ConfigError(f"{path}: GGUF metadata '{key}' should hold {n} integers, found {v[:8]!r}")
        return list(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{path}: GGUF metadata '{key}' is missing or not an integer ({v!r})")
    return [v] * n


def config(meta: dict, a: str, cfg: dict, tensors: dict, read: Callable[[str], torch.Tensor] | None,
           path) -> dict:
    """transformers' Gemma4TextConfig fields the common keys do not give."""
    n = cfg["num_hidden_layers"]
    pattern = meta.get(f"{a}.attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n:
        raise ConfigError(f"{path}: GGUF metadata '{a}.attention.sliding_window_pattern' should hold one flag per "
                          f"layer ({n}), found {pattern!r}")
    types = [LOCAL if p else GLOBAL for p in pattern]
    kv = _per_layer(meta, f"{a}.attention.head_count_kv", n, path)
    ffn = _per_layer(meta, f"{a}.feed_forward_length", n, path)
    shared = meta.get(f"{a}.attention.shared_kv_layers", 0)
    first_shared = n - shared
    local = [i for i in range(n) if types[i] == LOCAL] or [0]
    glob = [i for i in range(n) if types[i] == GLOBAL]
    k_eq_v = any(f"blk.{i}.attn_k.weight" in tensors and f"blk.{i}.attn_v.weight" not in tensors for i in glob)
    if any(kv[i] != kv[local[0]] for i in local) or any(kv[i] != kv[glob[0]] for i in glob):
        raise UnsupportedFormatError(f"{path}: {a}.attention.head_count_kv {kv} varies within local or global "
                                     "layers; supported: one count per kind")
    if kv[glob[0]] != kv[local[0]] and not k_eq_v:
        raise UnsupportedFormatError(f"{path}: global layers have {kv[glob[0]]} KV heads, local ones {kv[local[0]]}, "
                                     "without attention_k_eq_v (transformers' config cannot say so)")
    wide = [ffn[i] for i in range(first_shared, n)]
    double = bool(wide) and all(w == 2 * ffn[0] for w in wide)
    if any(f != ffn[0] for f in ffn[:first_shared]) or any(w != ffn[0] * (2 if double else 1) for w in wide):
        raise UnsupportedFormatError(f"{path}: {a}.feed_forward_length {ffn}; supported: one width, doubled on "
                                     "KV-shared layers or not")
    head_local = meta.get(f"{a}.attention.key_length_swa", cfg["head_dim"])
    if meta.get(f"{a}.rope.dimension_count_swa", head_local) != head_local:
        raise UnsupportedFormatError(f"{path}: local layers' rope turns {meta[f'{a}.rope.dimension_count_swa']} of "
                                     f"{head_local} channels; supported: all")
    out = {
        "hidden_activation": "gelu_pytorch_tanh", "layer_types": types, "head_dim": head_local,
        "global_head_dim": cfg["head_dim"], "num_key_value_heads": kv[local[0]],
        "num_global_key_value_heads": kv[glob[0]], "attention_k_eq_v": k_eq_v, "intermediate_size": ffn[0],
        "use_double_wide_mlp": double, "num_kv_shared_layers": shared,
        "sliding_window": meta.get(f"{a}.attention.sliding_window", 512),
        "hidden_size_per_layer_input": meta.get(f"{a}.embedding_length_per_layer_input", 0),
        "rope_parameters": {
            GLOBAL: {"rope_type": "proportional", "rope_theta": cfg["rope_theta"],
                     "partial_rotary_factor": _partial_rotary(tensors, read, cfg["head_dim"], path)},
            LOCAL: {"rope_type": "default", "rope_theta": float(meta.get(f"{a}.rope.freq_base_swa", 10_000.0))}},
    }
    if "per_layer_token_embd.weight" in tensors:
        out["vocab_size_per_layer_input"] = tensors["per_layer_token_embd.weight"].shape[-1]
    if f"{a}.final_logit_softcapping" in meta:
        out["final_logit_softcapping"] = float(meta[f"{a}.final_logit_softcapping"])
    if cfg.get("num_experts"):
        out.update(enable_moe_block=True, top_k_experts=cfg["num_experts_per_tok"])
    return out


def _partial_rotary(tensors: dict, read, head_dim: int, path) -> float:
    """The share of a global head's channels its rope turns, from ``rope_freqs`` (1 = turned, 1e30 = not)."""
    if "rope_freqs.weight" not in tensors or read is None:
        return 1.0
    f = read("rope_freqs.weight").float().reshape(-1)
    turned = int((f == 1.0).sum())
    if f.numel() != head_dim // 2 or not bool(((f == 1.0) | (f >= 1e29)).all()) or not bool((f[:turned] == 1).all()):
        raise UnsupportedFormatError(f"{path}: rope_freqs is not Gemma 4's proportional rope (1 for the first "
                                     f"channel pairs, 1e30 after; {f.numel()} entries for head_dim {head_dim})")
    return 2 * turned / head_dim
