"""Llama-family decoder (HF ``model_type`` llama; also Mistral-style dense models and SmolLM2).

Pure math with HF parameter names, so a checkpoint maps onto it one to one.
qwen2 and qwen3 reuse these classes with their own switches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quill.errors import ModelError
from quill.layers import (
    ACTIVATIONS,
    AttentionSpec,
    DecoderLayerSpec,
    Embedding,
    MLPSpec,
    Projections,
    RMSNorm,
    RopeConfig,
    RotaryEmbedding,
    apply_rope_qk,
    attend,
    linear,
    merged,
)
from quill.models.base import BaseModelArgs, DecoderLM, ForwardContext, LayerCache


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None  # Mistral / Mixtral: a window on every layer (None: global attention)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ModelError(f"config: hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                                 f"{self.num_attention_heads} and no head_dim is given")
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.check_positive("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                            "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelError(f"config: num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise ModelError(f"config hidden_act '{self.hidden_act}' is not supported; supported: "
                             f"{', '.join(ACTIVATIONS)}")
        self.rope = RopeConfig.from_config(self.rope_theta, self.rope_scaling, self.rope_parameters)

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings  # local layers attend their window, global ones everything

    def layer_window(self, layer: int) -> int | None:
        """Decoder layer ``layer``'s sliding window (it attends its last W positions, its own included), or
        None: it attends the whole context.  Mistral's convention: a ``sliding_window`` holds on every layer."""
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ModelError(f"config field 'sliding_window': expected a positive integer or null, found "
                             f"{self.sliding_window!r}")
        return self.sliding_window


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = self.head_dim ** -0.5
        self.window: int | None = None  # a local layer's sliding window (the model sets it per layer)
        self.q_proj = linear(args.hidden_size, self.n_heads * self.head_dim, qkv_bias)
        self.k_proj = linear(args.hidden_size, self.n_kv_heads * self.head_dim, qkv_bias)
        self.v_proj = linear(args.hidden_size, self.n_kv_heads * self.head_dim, qkv_bias)
        self.o_proj = linear(self.n_heads * self.head_dim, args.hidden_size, o_bias)
        self.qkv = merged(self.q_proj, self.k_proj, self.v_proj)  # one kernel call for the three

    def spec(self) -> AttentionSpec:
        return AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim, self.scale,
                             Projections(("q_proj", "k_proj", "v_proj"), self.qkv), self.o_proj, window=self.window)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, E] -> q [B, T, H, D], k and v [B, T, Hkv, D]."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        return (q.reshape(B, T, self.n_heads, self.head_dim), k.reshape(B, T, self.n_kv_heads, self.head_dim),
                v.reshape(B, T, self.n_kv_heads, self.head_dim))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: LayerCache | None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project(x)  # [B, T, H, D]
        q, k = apply_rope_qk(q, k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        out = attend(q, k, v, cache, mask, self.scale, self.window)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = linear(args.hidden_size, args.intermediate_size, args.mlp_bias)
        self.up_proj = linear(args.hidden_size, args.intermediate_size, args.mlp_bias)
        self.down_proj = linear(args.intermediate_size, args.hidden_size, args.mlp_bias)
        self.hidden_act, self.intermediate = args.hidden_act, args.intermediate_size
        self.act = ACTIVATIONS[args.hidden_act]
        self.gate_up = merged(self.gate_proj, self.up_proj)

    def spec(self) -> MLPSpec:
        return MLPSpec(Projections(("gate_proj", "up_proj"), self.gate_up), self.down_proj, self.hidden_act,
                       self.intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(*self.gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def feed_forward(self) -> nn.Module:
        return self.mlp

    def spec(self) -> DecoderLayerSpec:
        """What forward computes, as data (pre-norm residuals; the native decode step is built from it)."""
        return DecoderLayerSpec(self.input_layernorm, self.self_attn.spec(), self.post_attention_layernorm,
                                self.feed_forward().spec())

    def forward(self, x, rope, mask, cache):
        h = x + self.self_attn(self.input_layernorm(x), rope, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    """``model.*`` in HF naming: embeddings, decoder layers, final norm."""

    def __init__(self, args: ModelArgs, layers: list[nn.Module]):
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(DecoderLM):
    """``LlamaForCausalLM``: tokens -> logits."""

    qkv_bias = False  # subclasses (qwen2) switch these
    Attention = Attention
    # (regex, replacement) applied to checkpoint names before they are matched to slots
    checkpoint_aliases: tuple[tuple[str, str], ...] = ()

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.args = args
        self.dtype = dtype
        layers = [self.windowed(self.make_layer(args, i), i) for i in range(args.num_hidden_layers)]
        self.model = DecoderModel(args, layers)
        self.lm_head = linear(args.hidden_size, args.vocab_size, False)
        self.rotary = RotaryEmbedding(args.rope, args.head_dim)

    def make_attention(self, args: ModelArgs) -> nn.Module:
        return self.Attention(args, self.qkv_bias or args.attention_bias, args.attention_bias)

    def make_mlp(self, args: ModelArgs, layer: int) -> nn.Module:
        """The feed-forward block of decoder layer ``layer`` (MoE models choose dense or sparse per layer)."""
        return MLP(args)

    def make_layer(self, args: ModelArgs, layer: int) -> nn.Module:
        return DecoderLayer(args, self.make_attention(args), self.make_mlp(args, layer))

    def windowed(self, layer: nn.Module, index: int) -> nn.Module:
        """``layer`` with its attention's sliding window set from the config (None: global); layers without
        attention (a recurrent token mixer) have no window."""
        if isinstance(getattr(layer, "self_attn", None), Attention):
            layer.self_attn.window = self.args.layer_window(index)
        return layer

    def decoder_layer_specs(self) -> list[DecoderLayerSpec]:
        return [layer.spec() for layer in self.model.layers]

    @property
    def tied_embeddings(self) -> bool:
        return bool(self.args.tie_word_embeddings)

    def forward(self, tokens: torch.Tensor, ctx: ForwardContext, all_logits: bool = True) -> torch.Tensor:
        """tokens int64 [B, T] -> float32 logits [B, T, V] (or [B, 1, V]: the last position only).

        With ``ctx.logits_indices`` (int64 [N], positions in the flattened [B * T] tokens) only
        those positions get logits: [1, N, V] (the engine's packed batches).
        """
        h = self.model.embed_tokens(tokens, self.dtype)  # [B, T, E]
        rope = self.rotary(ctx.positions, self.dtype)
        if ctx.layers is not None:
            h = ctx.layers(h, rope)
        else:
            for i, layer in enumerate(self.model.layers):
                h = layer(h, rope, ctx.mask, ctx.layer_cache(i))
        if ctx.logits_indices is not None:
            h = h.reshape(-1, h.shape[-1])[ctx.logits_indices][None]  # [1, N, E]
        elif not all_logits:
            h = h[:, -1:]
        return self.lm_head(self.model.norm(h)).float()
