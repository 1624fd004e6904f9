"""Qwen3.5 (HF ``model_type`` qwen3_5_text, and the text part of qwen3_5): a hybrid decoder.

Most layers mix tokens with a Gated DeltaNet (``linear_attn``: a per-sequence recurrent state,
quill.layers.deltanet), every ``full_attention_interval``-th with gated attention (``self_attn``:
q_proj gives each head its query and an output gate, q/k norms, partial rotary), as
``layer_types`` lists.  Every RMSNorm but the DeltaNet's gated one is zero-centred (``1 + w``).
Multimodal rotary sections collapse to plain rotary for text (the three position rows are equal).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from quill.errors import ModelError
from quill.layers import (
    AttentionSpec,
    DecoderLayerSpec,
    Embedding,
    Projections,
    RopeConfig,
    RotaryEmbedding,
    attend,
    linear,
    merged,
    sigmoid,
)
from quill.layers.decoder import RecurrentSpec
from quill.layers.deltanet import DeltaNetDims, GatedDeltaNet, StateSpec
from quill.layers.gated_attention import OffsetRMSNorm, apply_partial_rope
from quill.models import llama
from quill.models.base import BaseModelArgs, DecoderLM, ForwardContext

log = logging.getLogger("quill.models")

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 0  # dense layers' MLP (0 in a MoE config without dense layers)
    num_key_value_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    rope_theta: float | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False  # what llama.MLP reads (Qwen3.5 has none)
    hidden_act: str = "silu"
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list | None = None
    full_attention_interval: int = 4
    # value heads in tiled order (key head j serves value heads j, j + Hk, ...), as llama.cpp's converter
    # writes them; HF checkpoints group them (key head j serves j*r .. j*r + r-1)
    linear_value_heads_tiled: bool = False

    @classmethod
    def from_dict(cls, params):
        """A text config, or a multimodal (qwen3_5 / qwen3_5_moe) one whose ``text_config`` holds the text model's."""
        text = params.get("text_config")
        if isinstance(text, dict):
            params = {**params, **text, "model_type": params.get("model_type")}
        return super().from_dict(params)

    def __post_init__(self):
        if self.layer_types is None:  # transformers' default pattern
            self.layer_types = [FULL if (i + 1) % self.full_attention_interval == 0 else LINEAR
                                for i in range(self.num_hidden_layers)]
        self.check_positive("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                            "head_dim", "vocab_size", "linear_conv_kernel_dim", "linear_key_head_dim",
                            "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads")
        bad = [t for t in self.layer_types if t not in (LINEAR, FULL)]
        if len(self.layer_types) != self.num_hidden_layers or bad:
            raise ModelError(f"config ({self.model_type}) field 'layer_types': expected {self.num_hidden_layers} "
                             f"of '{LINEAR}' / '{FULL}', found {self.layer_types}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelError(f"config: num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelError(f"config: linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                             f"linear_num_key_heads {self.linear_num_key_heads}")
        if self.hidden_act != "silu":
            raise ModelError(f"config hidden_act '{self.hidden_act}' is not supported; supported: silu")
        params = {k: v for k, v in (self.rope_parameters or {}).items()
                  if k not in ("mrope_section", "mrope_interleaved", "partial_rotary_factor")}
        self.rope = RopeConfig.from_config(self.rope_theta, None, params)
        factor = (self.rope_parameters or {}).get("partial_rotary_factor", self.partial_rotary_factor)
        self.rotary_dim = int(self.head_dim * (0.25 if factor is None else factor))
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ModelError(f"config: partial_rotary_factor {factor} gives {self.rotary_dim} rotary channels of "
                             f"head_dim {self.head_dim}; supported: an even number in (0, head_dim]")

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings

    def deltanet_dims(self) -> DeltaNetDims:
        return DeltaNetDims(self.hidden_size, self.linear_num_key_heads, self.linear_num_value_heads,
                            self.linear_key_head_dim, self.linear_value_head_dim, self.linear_conv_kernel_dim,
                            self.rms_norm_eps, self.linear_value_heads_tiled)


class GatedAttention(nn.Module):
    """``self_attn``: grouped-KV rotary attention whose q_proj also gives a sigmoid gate on the output."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = self.head_dim ** -0.5
        bias = args.attention_bias
        self.q_proj = linear(args.hidden_size, 2 * self.n_heads * self.head_dim, bias)  # per head: query, gate
        self.k_proj = linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias)
        self.v_proj = linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias)
        self.o_proj = linear(self.n_heads * self.head_dim, args.hidden_size, bias)
        self.q_norm = OffsetRMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, args.rms_norm_eps)
        self.qkv = merged(self.q_proj, self.k_proj, self.v_proj)
        self.rotary_dim = args.rotary_dim

    def spec(self) -> AttentionSpec:
        return AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim, self.scale,
                             Projections(("q_proj", "k_proj", "v_proj"), self.qkv), self.o_proj,
                             self.q_norm, self.k_norm, output_gate=True, rotary_dim=self.rotary_dim)

    def forward(self, x, rope, mask, cache):
        B, T, _ = x.shape
        qg, k, v = self.qkv(x)
        q, gate = qg.reshape(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.reshape(B, T, self.n_kv_heads, self.head_dim))
        q, k = apply_partial_rope(q, k, *rope)
        v = v.reshape(B, T, self.n_kv_heads, self.head_dim)
        out = attend(*(t.transpose(1, 2) for t in (q, k, v)), cache, mask, self.scale)  # [B, H, T, D]
        out = out.transpose(1, 2).reshape(B, T, -1) * sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    """Pre-norm residual layer with a DeltaNet (``linear_attn``) or gated attention (``self_attn``)."""

    def __init__(self, args: ModelArgs, index: int, mlp: nn.Module):
        super().__init__()
        self.index = index
        self.recurrent = args.layer_types[index] == LINEAR
        if self.recurrent:
            self.linear_attn = GatedDeltaNet(args.deltanet_dims())
        else:
            self.self_attn = GatedAttention(args)
        self.mlp = mlp
        self.input_layernorm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)

    def mixer_spec(self) -> AttentionSpec | RecurrentSpec:
        if self.recurrent:
            return RecurrentSpec(f"model.layers.{self.index}.linear_attn", self.linear_attn)
        return self.self_attn.spec()

    def spec(self) -> DecoderLayerSpec:
        return DecoderLayerSpec(self.input_layernorm, self.mixer_spec(), self.post_attention_layernorm,
                                self.mlp.spec())

    def forward(self, x, rope, mask, cache):
        h = self.input_layernorm(x)
        h = self.linear_attn(h, cache) if self.recurrent else self.self_attn(h, rope, mask, cache)
        h = x + h
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    def __init__(self, args: ModelArgs, layers: list[nn.Module]):
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(DecoderLM):
    """``Qwen3_5ForCausalLM`` (and the language model of ``Qwen3_5ForConditionalGeneration``)."""

    # a qwen3_5 (multimodal) checkpoint nests the text model under model.language_model
    checkpoint_aliases: tuple[tuple[str, str], ...] = ((r"^model\.language_model\.", "model."),)
    # the vision tower's tensors: not part of the text model (skipped with one log line)
    skipped_tensors = r"^(model\.visual|visual|mtp)\."

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.args, self.dtype = args, dtype
        layers = [DecoderLayer(args, i, self.make_mlp(args, i)) for i in range(args.num_hidden_layers)]
        self.model = DecoderModel(args, layers)
        self.lm_head = linear(args.hidden_size, args.vocab_size, False)
        self.rotary = RotaryEmbedding(args.rope, args.rotary_dim)

    def make_mlp(self, args: ModelArgs, layer: int) -> nn.Module:
        return llama.MLP(args)

    @property
    def tied_embeddings(self) -> bool:
        return bool(self.args.tie_word_embeddings)

    def decoder_layer_specs(self) -> list[DecoderLayerSpec]:
        return [layer.spec() for layer in self.model.layers]

    def state_specs(self) -> list[StateSpec | None]:
        """Per decoder layer the per-sequence state it keeps (None: it keeps keys and values in the KV cache)."""
        return [layer.linear_attn.state_spec() if layer.recurrent else None for layer in self.model.layers]

    def forward(self, tokens: torch.Tensor, ctx: ForwardContext, all_logits: bool = True) -> torch.Tensor:
        """tokens int64 [B, T] -> float32 logits (as ``llama.Model.forward``)."""
        h = self.model.embed_tokens(tokens, self.dtype)
        rope = self.rotary(ctx.positions, self.dtype)
        if ctx.layers is not None:
            h = ctx.layers(h, rope)
        else:
            for i, layer in enumerate(self.model.layers):
                h = layer(h, rope, ctx.mask, ctx.layer_cache(i))
        if ctx.logits_indices is not None:
            h = h.reshape(-1, h.shape[-1])[ctx.logits_indices][None]
        elif not all_logits:
            h = h[:, -1:]
        return self.lm_head(self.model.norm(h)).float()
