"""Gemma 4 text (HF ``model_type`` gemma4_text, and the language model of ``gemma4`` checkpoints).

Gemma 3's layer (a norm before and after attention and the MLP, a gelu-tanh gated MLP, the embedding scaled
by sqrt(hidden) in the table's dtype, q/k norms, local sliding-window layers between global ones, each kind
with its own rotary table, the final logits soft-capped when configured) with what transformers'
modeling_gemma4.py and llama.cpp's src/models/gemma4.cpp change:

* every RMSNorm is plain ``x_hat * w`` (Gemma 3's were ``x_hat * (1 + w)``); values get a weightless RMSNorm;
* attention is unscaled (``scaling = 1.0``: the q/k norms set the logits' size; no query_pre_attn_scalar);
* global layers have their own head size (``global_head_dim``) and, with ``attention_k_eq_v``, their own KV
  head count (``num_global_key_value_heads``) and no v_proj: values are the keys before their norm and rope;
  their rope is "proportional": only the first ``partial_rotary_factor`` of each head's channel pairs turn;
* per-layer input embeddings (PLE): a second table gives each token one small vector per layer, mixed with a
  projection of the embedding; each layer gates it by its output, projects it back and adds it
  (``hidden_size_per_layer_input`` 0 or null: none);
* each layer's output is multiplied by its ``layer_scalar``;
* the last ``num_kv_shared_layers`` layers compute no keys or values: each attends with those of the last
  earlier layer of its kind (local or global).  Here they read that layer's KV pool and own none.

The MoE variant (``enable_moe_block``, 26B-A4B) adds routed experts beside every layer's dense MLP: the router
reads the residual stream through a weightless RMSNorm times a learned scale and hidden^-0.5, softmax over
the experts, the top k renormalized and multiplied by per-expert scales; each branch has its own output norm
and the experts their own input norm.  The checkpoint stacks a layer's experts (gate and up in halves).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from quill.errors import ModelError
from quill.layers import (
    ACTIVATIONS,
    SANDWICH_NORM,
    AttentionSpec,
    DecoderLayerSpec,
    Embedding,
    ExpertsBesideSpec,
    KVPools,
    PerLayerInputSpec,
    Projections,
    RMSNorm,
    RopeConfig,
    RotaryEmbedding,
    SparseMoeBlock,
    apply_rope_q,
    apply_rope_qk,
    attend,
    check_moe_config,
    linear,
    merged,
    route,
    unit_rms_norm,
)
from quill.layers.stacked_experts import StackedExperts, Vector
from quill.models import llama
from quill.models.base import ForwardContext, LayerCache

log = logging.getLogger("quill.models")

LOCAL, GLOBAL = "sliding_attention", "full_attention"
# transformers' Gemma4TextConfig defaults, for the fields a multimodal checkpoint's text_config may leave out
TEXT_DEFAULTS = dict(vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072)
# transformers' rope defaults per layer kind (Gemma4TextConfig.__post_init__)
DEFAULT_ROPE = {LOCAL: {"rope_type": "default", "rope_theta": 10_000.0},
                GLOBAL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


@dataclass
class ModelArgs(llama.ModelArgs):
    hidden_activation: str = "gelu_pytorch_tanh"
    sliding_window: int | None = 512
    layer_types: list | None = None
    final_logit_softcapping: float | None = None
    use_bidirectional_attention: str | None = None
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    per_layer_config: dict | None = None
    tie_word_embeddings: bool = True
    rms_norm_eps: float = 1e-6

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> "ModelArgs":
        """A ``gemma4_text`` config, or a multimodal ``gemma4`` one whose ``text_config`` describes the decoder."""
        if params.get("model_type") == "gemma4":
            text = {**TEXT_DEFAULTS, **dict(params.get("text_config") or {})}
            params = {**text, "model_type": "gemma4", "tie_word_embeddings": params.get(
                "tie_word_embeddings", text.get("tie_word_embeddings", True))}
        if "hidden_size_per_layer_input" in params and not params["hidden_size_per_layer_input"]:
            params = {**params, "hidden_size_per_layer_input": 0}  # null means no PLE, not the default 256
        return super().from_dict(params)

    def __post_init__(self):
        self.hidden_act = self.hidden_activation
        n = self.num_hidden_layers
        if self.layer_types is None:  # transformers' default: every 6th layer global
            self.layer_types = [LOCAL if (i + 1) % 6 else GLOBAL for i in range(n)]
        if len(self.layer_types) != n or set(self.layer_types) - {LOCAL, GLOBAL}:
            raise ModelError(f"config field 'layer_types': expected {n} entries of '{LOCAL}' / '{GLOBAL}', "
                             f"found {self.layer_types!r}")
        self.layer_types = list(self.layer_types)
        self.layer_types[-1] = GLOBAL  # as transformers forces it (with a warning)
        ropes = {**DEFAULT_ROPE, **dict(self.rope_parameters or {})}
        self.rope_parameters = ropes[GLOBAL]
        super().__post_init__()
        self.global_rope = self.rope
        self.local_rope = RopeConfig.from_config(None, None, ropes[LOCAL])
        self._overrides()
        self.check_positive("global_head_dim")
        if self.use_bidirectional_attention == "all":
            raise ModelError("config field 'use_bidirectional_attention': 'all' is not supported (causal decoding; "
                             "'vision' concerns image tokens only and is accepted)")
        if self.enable_moe_block:
            check_moe_config(self.model_type, n, self.num_experts, self.top_k_experts, self.moe_intermediate_size)
        shared = self.num_kv_shared_layers
        if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared < n:
            raise ModelError(f"config field 'num_kv_shared_layers': expected 0 .. {n - 1}, found {shared!r}")
        first = n - shared
        for kind in set(self.layer_types):  # as transformers' kv_sharing_modes: every kind before the shared ones
            if shared and kind not in self.layer_types[:first]:
                raise ModelError(f"config: no '{kind}' layer before the KV-shared ones computes keys and values "
                                 f"(num_kv_shared_layers {shared}, layer_types {self.layer_types})")
        ple = self.hidden_size_per_layer_input
        if isinstance(ple, bool) or not isinstance(ple, int) or ple < 0:
            raise ModelError(f"config field 'hidden_size_per_layer_input': expected a non-negative integer, "
                             f"found {ple!r}")
        if ple:
            self.check_positive("vocab_size_per_layer_input")

    def _overrides(self) -> None:
        """transformers' per-layer overrides for global layers: ``global_head_dim``, and the KV head count
        ``num_global_key_value_heads`` when ``attention_k_eq_v``; or, in a config saved with them, the
        ``per_layer_config`` entries of global layers (their own head_dim / num_key_value_heads)."""
        self.global_kv_heads = self.num_key_value_heads
        if self.attention_k_eq_v and self.num_global_key_value_heads is not None:
            self.global_kv_heads = self.num_global_key_value_heads
        for key, over in (self.per_layer_config or {}).items():
            if str(key).isdigit() and int(key) < self.num_hidden_layers and self.layer_types[int(key)] == GLOBAL:
                self.global_head_dim = over.get("head_dim", self.global_head_dim)
                self.global_kv_heads = over.get("num_key_value_heads", self.global_kv_heads)
        if self.num_attention_heads % self.global_kv_heads:
            raise ModelError(f"config: num_attention_heads {self.num_attention_heads} is not a multiple of the "
                             f"global layers' KV heads {self.global_kv_heads}")

    def is_local(self, layer: int) -> bool:
        return self.layer_types[layer] == LOCAL

    def layer_window(self, layer: int) -> int | None:
        return super().layer_window(layer) if self.is_local(layer) else None

    def layer_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head dim) of layer ``layer``."""
        if self.is_local(layer):
            return self.num_key_value_heads, self.head_dim
        return self.global_kv_heads, self.global_head_dim

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values KV-shared layer ``layer`` attends with (the last layer of its kind
        before the shared ones), or None: ``layer`` computes its own."""
        first = self.num_hidden_layers - self.num_kv_shared_layers
        if layer < first:
            return None
        return max(i for i in range(first) if self.layer_types[i] == self.layer_types[layer])

    def layer_intermediate(self, layer: int) -> int:
        wide = self.use_double_wide_mlp and self.kv_source(layer) is not None
        return self.intermediate_size * (2 if wide else 1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.kind = args.layer_types[layer]
        self.window = args.layer_window(layer)
        self.n_heads = args.num_attention_heads
        self.n_kv_heads, self.head_dim = args.layer_shape(layer)
        self.scale = 1.0  # transformers' scaling = 1.0: the q/k norms set the logits' size
        self.eps = args.rms_norm_eps
        self.kv_source = args.kv_source(layer)
        self.shared = self.kv_source is not None
        hidden, bias, hd = args.hidden_size, args.attention_bias, self.head_dim
        self.q_proj = linear(hidden, self.n_heads * hd, bias)
        self.q_norm = RMSNorm(hd, args.rms_norm_eps)
        self.o_proj = linear(self.n_heads * hd, hidden, bias)
        names, parts = ["q_proj"], [self.q_proj]
        self.k_eq_v = args.attention_k_eq_v and self.window is None  # global layers: values are the keys
        if not self.shared:
            self.k_proj = linear(hidden, self.n_kv_heads * hd, bias)
            self.k_norm = RMSNorm(hd, args.rms_norm_eps)
            names.append("k_proj")
            parts.append(self.k_proj)
            if not self.k_eq_v:
                self.v_proj = linear(hidden, self.n_kv_heads * hd, bias)
                names.append("v_proj")
                parts.append(self.v_proj)
        self.names = tuple(names)
        self.qkv = merged(*parts)  # one kernel call for the projections this layer has

    def spec(self) -> AttentionSpec:
        return AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim, self.scale,
                             Projections(self.names, self.qkv), self.o_proj, q_norm=self.q_norm,
                             k_norm=getattr(self, "k_norm", None), window=self.window, value_norm_eps=self.eps,
                             values_from_keys=self.k_eq_v, kv_source=self.kv_source)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: LayerCache | None, shared: dict) -> torch.Tensor:
        """``cache``: this layer's, or for a KV-shared layer its source's (read, not written); ``shared``: kind
        -> (k, v) of the last layer of that kind in this forward (what shared layers attend without a cache)."""
        B, T, _ = x.shape
        out = self.qkv(x)
        q = self.q_norm(out[0].reshape(B, T, self.n_heads, self.head_dim))
        if self.shared:
            q = apply_rope_q(q, *rope).transpose(1, 2)  # [B, H, T, D]
            k = v = None
            if cache is None:
                k, v = shared[self.kind]
        else:
            k = out[1].reshape(B, T, self.n_kv_heads, self.head_dim)
            v = k if self.k_eq_v else out[2].reshape(B, T, self.n_kv_heads, self.head_dim)
            v = unit_rms_norm(v, self.eps)  # before k's norm and rope: with attention_k_eq_v, the raw keys
            q, k = apply_rope_qk(q, self.k_norm(k), *rope)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
            shared[self.kind] = (k, v)
        o = attend(q, k, v, cache, mask, self.scale, self.window)  # [B, H, T, D]
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MoE(SparseMoeBlock):
    """Gemma 4's routed experts (HF: ``router.{proj,scale,per_expert_scale}``, ``experts.{gate_up_proj,down_proj}``,
    aliased onto this block's ``gate``, ``router_scale``, ``per_expert_scale`` and ``stacked``)."""

    def __init__(self, args: ModelArgs, layer: int):
        E, H = args.num_experts, args.hidden_size
        super().__init__(f"model.layers.{layer}.moe", H, intermediate=args.moe_intermediate_size, num_experts=E,
                         top_k=args.top_k_experts, renormalize=True, hidden_act=args.hidden_activation)
        self.stacked = StackedExperts(E, H, args.moe_intermediate_size, self.deliver, halves=True)
        self.router_scale, self.per_expert_scale = Vector(H), Vector(E)
        self.eps, self.hidden = args.rms_norm_eps, H

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] the experts' input, ``residual`` [B, T, H] what the router reads -> [B, T, H]."""
        B, T, H = x.shape
        r = unit_rms_norm(residual.reshape(-1, H), self.eps) * self.router_scale.weight.to(x.dtype) * H ** -0.5
        # transformers' softmax over every expert, top k, renormalized: the softmax over the k (the native
        # step's routing, in double, rounded once)
        weights, ids = route(self.gate(r), self.top_k, True)  # [BT, k] each
        weights = weights * self.per_expert_scale.weight.float()[ids]
        return self.fused(x.reshape(-1, H), ids, weights).reshape(B, T, H)


class DecoderLayer(nn.Module):
    """Gemma 3's four norms, then the per-layer-input block, then the layer scalar (HF names)."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.index = layer
        self.self_attn = Attention(args, layer)
        # KV-shared layers' MLP is twice as wide with use_double_wide_mlp
        self.mlp = llama.MLP(SimpleNamespace(hidden_size=args.hidden_size, mlp_bias=False,
                                             intermediate_size=args.layer_intermediate(layer),
                                             hidden_act=args.hidden_activation))
        norm = lambda: RMSNorm(args.hidden_size, args.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.layer_scalar = Vector(1)
        self.ple = args.hidden_size_per_layer_input
        if self.ple:
            self.activation = args.hidden_activation
            self.act = ACTIVATIONS[args.hidden_activation]  # act(gate) * per-layer input, fused
            self.per_layer_input_gate = linear(args.hidden_size, self.ple, False)
            self.per_layer_projection = linear(self.ple, args.hidden_size, False)
            self.post_per_layer_input_norm = norm()
        self.moe = MoE(args, layer) if args.enable_moe_block else None
        if self.moe is not None:  # the dense MLP's and the experts' own norms
            self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2 = norm(), norm()
            self.pre_feedforward_layernorm_2 = norm()

    def spec(self) -> DecoderLayerSpec:
        """Gemma 3's layer (the MoE variant: routed experts beside the MLP) with a per-layer input block and a
        layer scalar after it."""
        ple, moe = None, None
        if self.moe is not None:
            m = self.moe
            moe = ExpertsBesideSpec(m.spec(), self.pre_feedforward_layernorm_2, self.post_feedforward_layernorm_1,
                                    self.post_feedforward_layernorm_2, m.router_scale, m.per_expert_scale, m.eps,
                                    m.hidden ** -0.5)
        if self.ple:
            ple = PerLayerInputSpec(self.per_layer_input_gate, self.per_layer_projection,
                                    self.post_per_layer_input_norm, self.activation, self.index, self.ple)
        return DecoderLayerSpec(self.input_layernorm, self.self_attn.spec(), self.pre_feedforward_layernorm,
                                self.mlp.spec(), SANDWICH_NORM, attention_out_norm=self.post_attention_layernorm,
                                ffn_out_norm=self.post_feedforward_layernorm,
                                rope="global" if self.self_attn.window is None else "local",
                                per_layer_input=ple, layer_scalar=self.layer_scalar, experts_beside=moe)

    def forward(self, x, rope, mask, cache, shared, per_layer_input):
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, mask, cache, shared))
        m = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe is not None:
            routed = self.moe(self.pre_feedforward_layernorm_2(h), h)
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(routed)
        h = h + self.post_feedforward_layernorm(m)
        if self.ple:
            g = self.act(self.per_layer_input_gate(h), per_layer_input)
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return h * self.layer_scalar.weight.to(h.dtype)


class Model(llama.Model):
    """``Gemma4ForCausalLM`` (and the text half of ``Gemma4ForConditionalGeneration``): tokens -> logits."""

    checkpoint_aliases = (
        # multimodal checkpoints: the language model's names (transformers 5)
        (r"^model\.language_model\.", "model."),
        # a buffer in transformers, a one-element vector slot here
        (r"\.layer_scalar$", ".layer_scalar.weight"),
        # the MoE variant's router and stacked experts, onto the layer's MoE block
        (r"^(model\.layers\.\d+)\.router\.proj\.", r"\1.moe.gate."),
        (r"^(model\.layers\.\d+)\.router\.scale$", r"\1.moe.router_scale.weight"),
        (r"^(model\.layers\.\d+)\.router\.per_expert_scale$", r"\1.moe.per_expert_scale.weight"),
        (r"^(model\.layers\.\d+)\.experts\.(gate_up_proj|down_proj)$", r"\1.moe.stacked.\2"),
        (r"(\.moe\.stacked\.gate_up_proj)\.weight$", r"\1"),  # a dense one from a GGUF file
    )
    # the multimodal checkpoint's vision and audio towers and their embedders: not part of the text model
    # (the loader skips them, one log line); KV-shared layers' k/v projections and norms, which
    # transformers ignores too, are added per config
    towers = r"^(model\.)?(vision_tower|audio_tower|embed_vision|embed_audio|multi_modal_projector)\."

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32):
        super().__init__(args, dtype)  # Llama's embedding, final norm (plain: x_hat * w) and lm_head
        self.rotary = RotaryEmbedding(args.global_rope, args.global_head_dim)
        self.local_rotary = RotaryEmbedding(args.local_rope, args.head_dim)
        n, ple = args.num_hidden_layers, args.hidden_size_per_layer_input
        if ple:
            self.model.embed_tokens_per_layer = Embedding(args.vocab_size_per_layer_input, n * ple)
            self.model.per_layer_model_projection = linear(args.hidden_size, n * ple, False)
            self.model.per_layer_projection_norm = RMSNorm(ple, args.rms_norm_eps)
        shared = [i for i in range(n) if args.kv_source(i) is not None]
        self.skipped_tensors = self.towers
        if shared:
            layers = "|".join(map(str, shared))
            self.skipped_tensors += rf"|^model\.layers\.({layers})\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\."

    def make_layer(self, args: ModelArgs, layer: int) -> nn.Module:
        return DecoderLayer(args, layer)

    def windowed(self, layer: nn.Module, index: int) -> nn.Module:
        return layer  # each Attention takes its window from the config itself

    def kv_layer_shapes(self) -> list[tuple[int, int] | None]:
        a = self.args
        return [a.layer_shape(i) if a.kv_source(i) is None else None for i in range(a.num_hidden_layers)]

    def native_refusal(self) -> str | None:
        """Why the native decode step cannot run this model, what it would need named; None: nothing Gemma 4 adds
        is missing (per-layer inputs, layer scalars, the value norm, per-layer head sizes and KV heads, values from
        the keys, KV-shared layers and the experts beside the MLP are in the layers' specs, and the step runs
        them; what the kernels chosen at load cannot run, quill.layers.native_step names by layer)."""
        need: list[str] = []  # (what a later Gemma 4 config adds that the step lacks goes here, named)
        a = self.args
        return f"Gemma 4 ({a.model_type}): the native decode step lacks " + "; ".join(need) if need else None

    def native_decode_step(self, cache: KVPools, states=None):
        why = self.native_refusal()
        if why is None:
            return super().native_decode_step(cache, states)
        log.info("native decode step: not built, the Python layers run (%s)", why)
        return None, why

    def per_layer_inputs(self, tokens: torch.Tensor, h: torch.Tensor) -> torch.Tensor | None:
        """[B, T, layers, P]: each token's own per-layer vectors mixed with a projection of its embedding
        ``h`` (transformers' get_per_layer_inputs + project_per_layer_inputs), or None without PLE."""
        a, m = self.args, self.model
        P = a.hidden_size_per_layer_input
        if not P:
            return None
        t = m.embed_tokens_per_layer
        e = t(tokens, t.table_dtype)
        e = (e * torch.tensor(P ** 0.5, dtype=e.dtype)).to(self.dtype)  # scaled in the table's dtype
        shape = (*tokens.shape, a.num_hidden_layers, P)
        proj = m.per_layer_projection_norm((m.per_layer_model_projection(h) * a.hidden_size ** -0.5).reshape(shape))
        return (proj + e.reshape(shape)) * 2 ** -0.5

    def forward(self, tokens: torch.Tensor, ctx: ForwardContext, all_logits: bool = True) -> torch.Tensor:
        """tokens int64 [B, T] -> float32 logits (as ``llama.Model.forward``)."""
        if ctx.layers is not None and self.native_refusal() is not None:
            raise ModelError(self.native_refusal())
        emb = self.model.embed_tokens
        e = emb(tokens, emb.table_dtype)
        # scaled in the table's dtype, as transformers does (a bfloat16 table rounds sqrt(hidden) first)
        h = (e * torch.tensor(self.args.hidden_size ** 0.5, dtype=e.dtype)).to(self.dtype)
        ple = self.per_layer_inputs(tokens, h)
        ropes = {GLOBAL: self.rotary(ctx.positions, self.dtype), LOCAL: self.local_rotary(ctx.positions, self.dtype)}
        shared: dict = {}
        if ctx.layers is not None:  # the native step: each layer turns by the table its spec names
            h = ctx.layers(h, {"global": ropes[GLOBAL], "local": ropes[LOCAL]}, per_layer=ple)
        for i, layer in enumerate(self.model.layers if ctx.layers is None else ()):
            source = self.args.kv_source(i)
            cache = ctx.layer_cache(i if source is None else source)
            h = layer(h, ropes[self.args.layer_types[i]], ctx.mask, cache, shared,
                      None if ple is None else ple[:, :, i].contiguous())
        if ctx.logits_indices is not None:
            h = h.reshape(-1, h.shape[-1])[ctx.logits_indices][None]  # [1, N, E]
        elif not all_logits:
            h = h[:, -1:]
        logits = self.lm_head(self.model.norm(h)).float()
        cap = self.args.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

