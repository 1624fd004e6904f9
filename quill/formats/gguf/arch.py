"""What a GGUF architecture means in Hugging Face terms: tensor names, config, q/k layout.

llama.cpp's ``convert_hf_to_gguf.py`` renames HF tensors (``tensor_mapping.py``),
writes the config as ``<arch>.*`` metadata, and, for the llama family only
(``LlamaModel.permute``), interleaves the rows of ``q_proj``/``k_proj`` (weights
and biases) per head so that its "normal" RoPE rotates adjacent pairs.  HF's
RoPE rotates the two halves of each head, so reading a llama GGUF back needs the
inverse row permutation; qwen2/qwen3(+moe) are written unpermuted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from quill.errors import CheckpointError, ConfigError, UnsupportedFormatError, format_choices
from quill.formats.gguf import gemma4
from quill.formats.gguf.quants import BF16, F16


@dataclass(frozen=True)
class ArchSpec:
    """One GGUF ``general.architecture`` (and its MoE variant, where it has one)."""

    model_type: str
    architecture: str
    permute_qk: bool
    moe_model_type: str | None = None
    moe_architecture: str | None = None
    moe_prefix: str = "mlp"  # HF module holding the router and experts
    block_names: tuple[tuple[str, str], ...] = ()  # this architecture's own blk.N.<leaf> -> HF module names
    hybrid: bool = False  # Qwen3.5: Gated DeltaNet layers (ssm_*) beside attention, zero-centred norms
    offset_norms: bool = False  # Gemma 3: every norm stored as 1 + w by the converter (undone on load)
    global_names: tuple[tuple[str, str], ...] = ()  # this architecture's own top-level tensors -> HF names
    in_config: tuple[str, ...] = ()  # tensors read into the config, not loaded (Gemma 4's rope_freqs)


# Qwen3.5's Gated DeltaNet tensors (llama.cpp's QWEN35 names); ssm_a and ssm_dt.bias are mapped in map_name
_QWEN35_NAMES = (
    ("attn_qkv", "linear_attn.in_proj_qkv"), ("attn_gate", "linear_attn.in_proj_z"),
    ("ssm_beta", "linear_attn.in_proj_b"), ("ssm_alpha", "linear_attn.in_proj_a"),
    ("ssm_conv1d", "linear_attn.conv1d"), ("ssm_norm", "linear_attn.norm"), ("ssm_out", "linear_attn.out_proj"),
    ("post_attention_norm", "post_attention_layernorm"),
)
# what llama.cpp's converter changed in a Qwen3.5 file, undone on load (conversion/qwen.py, Qwen3NextModel):
# zero-centred norms written as 1 + w, A_log as ssm_a = -exp(A_log), the conv weight squeezed to [C, K]
_QWEN35_OFFSET_NORMS = ("attn_norm", "post_attention_norm", "output_norm", "attn_q_norm", "attn_k_norm")
_SSM_A = re.compile(r"blk\.(\d+)\.ssm_a")
_SSM_DT = re.compile(r"blk\.(\d+)\.ssm_dt\.bias")

# Gemma 3's norms around attention and the MLP (llama.cpp's GEMMA3 names; ffn_norm is the MLP's input norm)
_GEMMA3_NAMES = (
    ("post_attention_norm", "post_attention_layernorm"), ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
)

# gpt-oss (llama.cpp's OPENAI_MOE, general.architecture "gpt-oss"): the sinks and the norm the MoE block reads
_GPT_OSS_NAMES = (("attn_sinks", "self_attn.sinks"), ("post_attention_norm", "post_attention_layernorm"))

ARCHS: dict[str, ArchSpec] = {
    # Mixtral is written as general.architecture "llama" with expert tensors.
    "llama": ArchSpec("llama", "LlamaForCausalLM", True, "mixtral", "MixtralForCausalLM", "block_sparse_moe"),
    "qwen2": ArchSpec("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ArchSpec("qwen3", "Qwen3ForCausalLM", False),
    "qwen2moe": ArchSpec("qwen2_moe", "Qwen2MoeForCausalLM", False, "qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ArchSpec("qwen3_moe", "Qwen3MoeForCausalLM", False, "qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen35": ArchSpec("qwen3_5_text", "Qwen3_5ForCausalLM", False, block_names=_QWEN35_NAMES, hybrid=True),
    "qwen35moe": ArchSpec("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", False, "qwen3_5_moe_text",
                          "Qwen3_5MoeForCausalLM", block_names=_QWEN35_NAMES, hybrid=True),
    "gemma3": ArchSpec("gemma3_text", "Gemma3ForCausalLM", False, block_names=_GEMMA3_NAMES, offset_norms=True),
    "gemma4": ArchSpec("gemma4_text", "Gemma4ForCausalLM", False, "gemma4_text", "Gemma4ForCausalLM", "moe",
                       block_names=gemma4.NAMES,
                       global_names=tuple(gemma4.GLOBAL_NAMES.items()), in_config=("rope_freqs.weight",)),
    "gpt-oss": ArchSpec("gpt_oss", "GptOssForCausalLM", False, "gpt_oss", "GptOssForCausalLM",
                        block_names=_GPT_OSS_NAMES),
}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "{moe}.gate",  # router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Old Mixtral files store one 2-D tensor per expert: blk.N.ffn_gate.E.weight.
_LEGACY_EXPERT_NAMES = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z][a-z0-9_]*)(?:\.(\d+))?\.(weight|bias)")  # ssm_conv1d


@dataclass(frozen=True)
class TensorName:
    """Where a GGUF tensor goes: an HF module and suffix, one module per expert for 3-D expert tensors."""

    gguf: str
    module: str  # HF module name; contains "{expert}" for a stacked expert tensor
    suffix: str  # "weight" or "bias"
    stacked_experts: bool = False

    def hf(self, expert: int | None = None) -> str:
        module = self.module.format(expert=expert) if self.stacked_experts else self.module
        return f"{module}.{self.suffix}"


def arch_spec(arch: str, path) -> ArchSpec:
    if arch not in ARCHS:
        raise UnsupportedFormatError(
            f"{path}: GGUF architecture '{arch}' is not supported; supported: {format_choices(ARCHS)}")
    return ARCHS[arch]


def map_name(gguf_name: str, spec: ArchSpec, is_moe: bool, path) -> TensorName:
    """The HF name of one GGUF tensor, or ``UnsupportedFormatError`` naming it."""
    stem, _, suffix = gguf_name.rpartition(".")
    if spec.model_type == "gemma4_text" and (module := gemma4.scale_name(gguf_name)):
        return TensorName(gguf_name, module, "weight")
    if spec.hybrid and (m := _SSM_A.fullmatch(gguf_name) or _SSM_DT.fullmatch(gguf_name)):
        attr = "A_log" if m.re is _SSM_A else "dt_bias"  # parameters of the linear_attn module itself
        return TensorName(gguf_name, f"model.layers.{m.group(1)}.linear_attn", attr)
    global_names = {**_GLOBAL_NAMES, **dict(spec.global_names)}
    if stem in global_names and suffix in ("weight", "bias"):
        return TensorName(gguf_name, global_names[stem], suffix)
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m:
        layer, leaf, expert, suffix = m.groups()
        prefix = f"model.layers.{layer}"
        moe = spec.moe_prefix if is_moe else "mlp"
        if expert is not None and leaf in _LEGACY_EXPERT_NAMES:
            return TensorName(gguf_name, f"{prefix}.{moe}.experts.{expert}.{_LEGACY_EXPERT_NAMES[leaf]}", suffix)
        if expert is None and leaf in _EXPERT_NAMES:
            return TensorName(gguf_name, f"{prefix}.{moe}.experts.{{expert}}.{_EXPERT_NAMES[leaf]}", suffix, True)
        names = {**_BLOCK_NAMES, **dict(spec.block_names)}
        if expert is None and leaf in names:
            return TensorName(gguf_name, f"{prefix}.{names[leaf].format(moe=moe)}", suffix)
    raise UnsupportedFormatError(
        f"{path}: tensor '{gguf_name}' has no Hugging Face name quill knows for this architecture; "
        f"supported: token_embd, output_norm, output, blk.N.{{{', '.join(sorted(_BLOCK_NAMES))}}}, "
        f"blk.N.{{{', '.join(sorted(_EXPERT_NAMES))}}}")


def converter_undo(gguf_name: str, spec: ArchSpec):
    """The inverse of what llama.cpp's converter did to a dense tensor of ``spec`` (a function of the
    tensor), or None."""
    leaf = gguf_name.rpartition(".weight")[0].rpartition(".")[2] if gguf_name.endswith(".weight") else ""
    if spec.offset_norms and leaf.endswith("norm"):
        return lambda t: t.float() - 1.0  # Gemma's converter wrote 1 + w; the model adds the 1 back
    if not spec.hybrid:
        return None
    if leaf in _QWEN35_OFFSET_NORMS or gguf_name == "output_norm.weight":
        return lambda t: t.float() - 1.0  # the model adds the 1 back (zero-centred RMSNorm)
    if _SSM_A.fullmatch(gguf_name):
        return lambda t: torch.log(-t.float())  # ssm_a = -exp(A_log)
    if leaf == "ssm_conv1d":
        return lambda t: t.reshape(t.shape[0], 1, t.shape[-1])  # [C, K] -> HF's [C, 1, K]
    return None


def qk_heads(gguf_name: str, config: dict) -> int | None:
    """Heads to un-interleave for a permuted q/k tensor (llama family), else None."""
    if ".attn_q." in gguf_name:
        return config["num_attention_heads"]
    if ".attn_k." in gguf_name:
        return config["num_key_value_heads"]
    return None


def unpermute_index(rows: int, n_head: int, name: str) -> torch.Tensor:
    """Row index turning llama.cpp's interleaved q/k rows back into HF's order.

    llama.cpp writes ``hf.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``: GGUF row
    ``h*d + 2j + i`` holds HF row ``h*d + i*d/2 + j``.  So HF = GGUF[index] with
    ``index = arange(rows).reshape(n_head, d/2, 2).transpose(1, 2).flatten()``.
    """
    if n_head <= 0 or rows % (2 * n_head):
        raise CheckpointError(f"tensor '{name}': {rows} rows cannot be split into {n_head} heads of even size")
    return torch.arange(rows).reshape(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(-1)


# ---- config ------------------------------------------------------------------

def _int(meta: dict, key: str, path, default=...) -> int:
    v = meta.get(key, default)
    if v is ...:
        raise ConfigError(f"{path}: GGUF metadata '{key}' is missing")
    if isinstance(v, list):  # per-layer values (some architectures); quill needs them uniform
        if not v or any(x != v[0] for x in v):
            raise ConfigError(f"{path}: GGUF metadata '{key}' varies per layer ({v[:8]}...); supported: one value")
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{path}: GGUF metadata '{key}' should be an integer, found {v!r}")
    return v


def _float(meta: dict, key: str, path, default=...) -> float:
    v = meta.get(key, default)
    if v is ...:
        raise ConfigError(f"{path}: GGUF metadata '{key}' is missing")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{path}: GGUF metadata '{key}' should be a number, found {v!r}")
    return float(v)


def _rope_scaling(meta: dict, a: str, path) -> dict | None:
    kind = meta.get(f"{a}.rope.scaling.type")
    factor = meta.get(f"{a}.rope.scaling.factor", meta.get(f"{a}.rope.scale_linear"))
    if kind is None and factor is not None:
        kind = "linear"  # the older key rope.scale_linear
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": _float(meta, f"{a}.rope.scaling.factor", path, factor or 1.0)}
    if f"{a}.rope.scaling.original_context_length" in meta:
        scaling["original_max_position_embeddings"] = _int(meta, f"{a}.rope.scaling.original_context_length", path)
    for key, field in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                       ("yarn_attn_factor", "attention_factor")):
        if f"{a}.rope.scaling.{key}" in meta:
            scaling[field] = _float(meta, f"{a}.rope.scaling.{key}", path)
    return scaling


def build_config(meta: dict, arch: str, tensors: dict, n_tokens: int | None, path, read=None) -> dict:
    """An HF-style ``config.json`` dict from GGUF metadata (``<arch>.*`` and ``tokenizer.ggml.*``); ``read``:
    name -> tensor, for what an architecture keeps in a tensor (Gemma 4's rope_freqs)."""
    spec = arch_spec(arch, path)
    a = arch
    full_meta = meta
    if spec.model_type == "gemma4_text":
        meta = gemma4.uniform_view(meta, a)  # per-layer arrays, read per layer below
    n_experts = _int(meta, f"{a}.expert_count", path, 0)
    is_moe = n_experts > 0
    if is_moe and spec.moe_model_type is None:
        moe_archs = format_choices(name for name, s in ARCHS.items() if s.moe_model_type)
        raise UnsupportedFormatError(f"{path}: '{arch}' with {n_experts} experts is not supported; "
                                     f"MoE architectures: {moe_archs}")
    hidden = _int(meta, f"{a}.embedding_length", path)
    heads = _int(meta, f"{a}.attention.head_count", path)
    head_dim = _int(meta, f"{a}.attention.key_length", path, hidden // heads)
    rope_dim = _int(meta, f"{a}.rope.dimension_count", path, head_dim)
    if rope_dim != head_dim and not spec.hybrid:
        raise UnsupportedFormatError(f"{path}: {a}.rope.dimension_count {rope_dim} differs from head_dim "
                                     f"{head_dim} (partial rotary); supported: full rotary")
    vocab = meta.get(f"{a}.vocab_size", n_tokens)
    if vocab is None and "token_embd.weight" in tensors:
        vocab = tensors["token_embd.weight"].shape[1]
    cfg = {
        "model_type": spec.moe_model_type if is_moe else spec.model_type,
        "architectures": [spec.moe_architecture if is_moe else spec.architecture],
        "hidden_size": hidden,
        "num_hidden_layers": _int(meta, f"{a}.block_count", path),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(meta, f"{a}.attention.head_count_kv", path, heads),
        "head_dim": head_dim,
        "rms_norm_eps": _float(meta, f"{a}.attention.layer_norm_rms_epsilon", path),
        "rope_theta": _float(meta, f"{a}.rope.freq_base", path, 10000.0),
        "max_position_embeddings": _int(meta, f"{a}.context_length", path),
        "vocab_size": vocab,
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": any(n.endswith(".attn_q.bias") for n in tensors),
        "torch_dtype": _torch_dtype(tensors),
    }
    ffn = meta.get(f"{a}.feed_forward_length")
    if ffn is not None or not is_moe:
        cfg["intermediate_size"] = _int(meta, f"{a}.feed_forward_length", path)
    rope_scaling = _rope_scaling(meta, a, path)
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    if is_moe:
        cfg.update(_moe_config(meta, a, spec, n_experts, cfg, path))
    if spec.hybrid:
        cfg.update(_hybrid_config(meta, a, cfg, rope_dim, path))
    if spec.model_type == "gemma3_text":
        cfg.update(_gemma3_config(meta, a, cfg, path))
    if spec.model_type == "gpt_oss":
        cfg.update(_gpt_oss_config(meta, a, cfg, path))
    if spec.model_type == "gemma4_text":
        cfg.update(gemma4.config(full_meta, a, cfg, tensors, read, path))
    for key, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                       ("padding_token_id", "pad_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            cfg[field] = _int(meta, f"tokenizer.ggml.{key}", path)
    return cfg


def _moe_config(meta: dict, a: str, spec: ArchSpec, n_experts: int, cfg: dict, path) -> dict:
    used = _int(meta, f"{a}.expert_used_count", path)
    if spec.moe_prefix == "block_sparse_moe":  # mixtral: experts share intermediate_size
        return {"num_local_experts": n_experts, "num_experts_per_tok": used}
    moe = {
        "num_experts": n_experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": _int(meta, f"{a}.expert_feed_forward_length", path),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        # llama.cpp renormalizes the top-k weights for qwen3moe, not for qwen2moe.
        "norm_topk_prob": bool(meta.get(f"{a}.expert_weights_norm", spec.model_type == "qwen3_moe")),
    }
    if f"{a}.expert_shared_feed_forward_length" in meta:
        moe["shared_expert_intermediate_size"] = _int(meta, f"{a}.expert_shared_feed_forward_length", path)
    cfg.setdefault("intermediate_size", moe["moe_intermediate_size"])
    return moe


def _hybrid_config(meta: dict, a: str, cfg: dict, rope_dim: int, path) -> dict:
    """Qwen3.5's Gated DeltaNet fields (llama.cpp's ssm.* metadata) and which layers are recurrent."""
    recurrent = meta.get(f"{a}.attention.recurrent_layers")
    if not isinstance(recurrent, list) or len(recurrent) != cfg["num_hidden_layers"]:
        raise ConfigError(f"{path}: GGUF metadata '{a}.attention.recurrent_layers' should list "
                          f"{cfg['num_hidden_layers']} booleans, found {recurrent!r}")
    value_heads = _int(meta, f"{a}.ssm.time_step_rank", path)
    return {
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
        "linear_conv_kernel_dim": _int(meta, f"{a}.ssm.conv_kernel", path),
        "linear_key_head_dim": _int(meta, f"{a}.ssm.state_size", path),
        "linear_num_key_heads": _int(meta, f"{a}.ssm.group_count", path),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": _int(meta, f"{a}.ssm.inner_size", path) // value_heads,
        "partial_rotary_factor": rope_dim / cfg["head_dim"],
        # the converter reorders value heads from grouped by key head to tiled (ggml's broadcast order)
        "linear_value_heads_tiled": True,
    }


def _torch_dtype(tensors: dict) -> str:
    """The float dtype of the file's dense 2-D weights; float32 (what ggml computes in) when all are quantized."""
    kinds = {t.ggml_type for t in tensors.values() if len(t.shape) >= 2}
    if BF16 in kinds:
        return "bfloat16"
    if F16 in kinds:
        return "float16"
    return "float32"


def _gemma3_config(meta: dict, a: str, cfg: dict, path) -> dict:
    """What llama.cpp reads for Gemma 3 besides the common keys (src/models/gemma3.cpp): the window, which
    layers are local (``sliding_window_pattern``: a period, default 6, or one flag per layer), their rope base
    (default 10000), the final soft-cap, and the query scale the file does not store (1 / sqrt(head_dim), but
    hidden / heads for the 62-layer 27B, as llama.cpp and Gemma's own config do)."""
    n = cfg["num_hidden_layers"]
    out = {"hidden_activation": "gelu_pytorch_tanh",
           "rope_local_base_freq": _float(meta, f"{a}.rope.freq_base_swa", path, 10000.0),
           "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if n == 62 else cfg["head_dim"]}
    window = _int(meta, f"{a}.attention.sliding_window", path, 0)
    pattern = meta.get(f"{a}.attention.sliding_window_pattern", 6)
    if window > 0:
        if isinstance(pattern, (list, tuple)):
            local = [bool(p) for p in pattern]
            if len(local) != n:
                raise UnsupportedFormatError(f"{path}: {a}.attention.sliding_window_pattern has {len(local)} "
                                             f"entries for {n} layers")
        else:
            period = int(pattern)
            local = [period == 0 or i % period < period - 1 for i in range(n)]
        out["sliding_window"] = window
        out["layer_types"] = ["sliding_attention" if x else "full_attention" for x in local]
    else:
        out["sliding_window"] = None  # no local layers
        out["layer_types"] = ["full_attention"] * n
    if f"{a}.final_logit_softcapping" in meta:
        out["final_logit_softcapping"] = _float(meta, f"{a}.final_logit_softcapping", path)
    return out


def _gpt_oss_config(meta: dict, a: str, cfg: dict, path) -> dict:
    """What llama.cpp assumes for gpt-oss besides the common keys (src/llama-model.cpp, LLM_ARCH_OPENAI_MOE):
    the window on every other layer starting with the first (transformers' default ``layer_types``), the
    clamped SwiGLU's constants (1.702, 7: gpt-oss's, not in the file) and YaRN's ramp untruncated, as
    gpt-oss's config says (``truncate: false``; ggml rounds the ramp's ends out to whole channel pairs)."""
    out = {"sliding_window": _int(meta, f"{a}.attention.sliding_window", path), "layer_types": None,
           "num_local_experts": cfg["num_experts"], "intermediate_size": cfg["moe_intermediate_size"]}
    scaling = cfg.get("rope_scaling")
    if scaling is None:  # no scaling in the file: none, not the YaRN transformers assumes for a bare config
        out["rope_scaling"] = {"rope_type": "default"}
    elif scaling.get("rope_type") == "yarn":
        out["rope_scaling"] = {**scaling, "truncate": False}
    return out
