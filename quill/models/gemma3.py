"""Gemma 3 text (HF ``model_type`` gemma3_text, and the language model of ``gemma3`` checkpoints).

The Llama decoder with: (1 + w) RMSNorms, a norm before and after both attention and the MLP
(four per layer), a gelu-tanh gated MLP, the embedding scaled by sqrt(hidden) in the table's dtype,
q/k RMSNorms, attention scaled by ``query_pre_attn_scalar ** -0.5``, local layers (a sliding window,
their own rope base ``rope_local_base_freq``) between global ones (rope scaling as configured), and
the final logits soft-capped when the config says so.  transformers' modeling_gemma3.py and
llama.cpp's src/models/gemma3.cpp compute the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quill.errors import ModelError
from quill.layers import SANDWICH_NORM, DecoderLayerSpec, RopeConfig, RotaryEmbedding
from quill.layers.gated_attention import OffsetRMSNorm
from quill.models import llama
from quill.models.base import ForwardContext

LOCAL, GLOBAL = "sliding_attention", "full_attention"
# transformers' Gemma3TextConfig defaults, for the fields a multimodal checkpoint's text_config may leave out
TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072)


@dataclass
class ModelArgs(llama.ModelArgs):
    hidden_activation: str = "gelu_pytorch_tanh"
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    layer_types: list | None = None
    sliding_window_pattern: int = 6  # older configs: every 6th layer global, the others local
    rope_local_base_freq: float = 10_000.0
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: bool = False
    tie_word_embeddings: bool = True
    rms_norm_eps: float = 1e-6

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> "ModelArgs":
        """A ``gemma3_text`` config, or a multimodal ``gemma3`` one whose ``text_config`` describes the decoder."""
        if params.get("model_type") == "gemma3":
            text = {**TEXT_DEFAULTS, **dict(params.get("text_config") or {})}
            params = {**text, "model_type": "gemma3", "tie_word_embeddings": params.get(
                "tie_word_embeddings", text.get("tie_word_embeddings", True))}
        return super().from_dict(params)

    def __post_init__(self):
        self.hidden_act = self.hidden_activation
        # transformers 5 writes one rope_parameters entry per layer type; older configs rope_theta (global),
        # rope_scaling (global layers only) and rope_local_base_freq
        params = dict(self.rope_parameters or {})
        local = params.get(LOCAL) or {"rope_type": "default", "rope_theta": self.rope_local_base_freq}
        self.rope_parameters = params.get(GLOBAL) if GLOBAL in params or LOCAL in params else (params or None)
        if self.rope_theta is None and not (self.rope_parameters or {}).get("rope_theta"):
            self.rope_theta = 1_000_000.0  # transformers' default global base
        super().__post_init__()
        self.local_rope = RopeConfig.from_config(self.rope_local_base_freq, None, local)
        if self.attn_logit_softcapping is not None:
            raise ModelError(f"config field 'attn_logit_softcapping': {self.attn_logit_softcapping} is not "
                             "supported (attention runs without soft-capping; Gemma 3 checkpoints set null)")
        if self.use_bidirectional_attention:
            raise ModelError("config field 'use_bidirectional_attention': true is not supported (causal decoding "
                             "only)")
        if self.layer_types is not None and (len(self.layer_types) != self.num_hidden_layers
                                             or set(self.layer_types) - {LOCAL, GLOBAL}):
            raise ModelError(f"config field 'layer_types': expected {self.num_hidden_layers} entries of "
                             f"'{LOCAL}' / '{GLOBAL}', found {self.layer_types!r}")

    def layer_window(self, layer: int) -> int | None:
        if self.layer_types is not None:
            local = self.layer_types[layer] == LOCAL
        else:
            local = bool((layer + 1) % self.sliding_window_pattern)
        return super().layer_window(layer) if local else None


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, qkv_bias: bool, o_bias: bool):
        super().__init__(args, qkv_bias, o_bias)
        self.scale = float(args.query_pre_attn_scalar) ** -0.5
        self.q_norm = OffsetRMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, args.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(x)  # [B, T, H, D]: the norms act on each head's D channels
        return self.q_norm(q), self.k_norm(k), v

    def spec(self):
        return dataclasses.replace(super().spec(), q_norm=self.q_norm, k_norm=self.k_norm)


class DecoderLayer(nn.Module):
    """Norms before and after attention and before and after the MLP (HF names)."""

    def __init__(self, args: ModelArgs, attention: Attention, mlp: nn.Module):
        super().__init__()
        self.self_attn, self.mlp = attention, mlp
        norm = lambda: OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def spec(self) -> DecoderLayerSpec:
        return DecoderLayerSpec(self.input_layernorm, self.self_attn.spec(), self.pre_feedforward_layernorm,
                                self.mlp.spec(), SANDWICH_NORM, attention_out_norm=self.post_attention_layernorm,
                                ffn_out_norm=self.post_feedforward_layernorm,
                                rope="global" if self.self_attn.window is None else "local")

    def forward(self, x, rope, mask, cache):
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, mask, cache))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Model(llama.Model):
    """``Gemma3ForCausalLM`` (and the text half of ``Gemma3ForConditionalGeneration``): tokens -> logits."""

    Attention = Attention
    checkpoint_aliases = (
        # multimodal checkpoints: transformers 5 (model.language_model.*) and 4 (language_model.model.*) names
        (r"^model\.language_model\.", "model."),
        (r"^language_model\.model\.", "model."),
        (r"^language_model\.lm_head\.", "lm_head."),
    )
    # their vision tower and projector: not part of the text model (the loader skips them, one log line)
    skipped_tensors = r"^(model\.)?(vision_tower|multi_modal_projector)\."

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32):
        super().__init__(args, dtype)
        self.model.norm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.local_rotary = RotaryEmbedding(args.local_rope, args.head_dim)

    def make_layer(self, args: ModelArgs, layer: int) -> nn.Module:
        return DecoderLayer(args, self.make_attention(args), self.make_mlp(args, layer))

    def forward(self, tokens: torch.Tensor, ctx: ForwardContext, all_logits: bool = True) -> torch.Tensor:
        """tokens int64 [B, T] -> float32 logits (as ``llama.Model.forward``)."""
        emb = self.model.embed_tokens
        e = emb(tokens, emb.table_dtype)
        # scaled in the table's dtype, as transformers does (a bfloat16 table rounds sqrt(hidden) first)
        h = (e * torch.tensor(self.args.hidden_size ** 0.5, dtype=e.dtype)).to(self.dtype)
        ropes = {"global": self.rotary(ctx.positions, self.dtype),
                 "local": self.local_rotary(ctx.positions, self.dtype)}
        if ctx.layers is not None:
            h = ctx.layers(h, ropes)  # each layer turns by the table its spec names (DecoderLayerSpec.rope)
        else:
            for i, layer in enumerate(self.model.layers):
                rope = ropes["global" if layer.self_attn.window is None else "local"]
                h = layer(h, rope, ctx.mask, ctx.layer_cache(i))
        if ctx.logits_indices is not None:
            h = h.reshape(-1, h.shape[-1])[ctx.logits_indices][None]  # [1, N, E]
        elif not all_logits:
            h = h[:, -1:]
        logits = self.lm_head(self.model.norm(h)).float()
        cap = self.args.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
