"""A decoder layer described as data: what the native decode step is built from.

Each model file says what its decoder layer computes (``DecoderLayer.spec()``): its
norms, its attention variant (q/k norms or not; biases are the linears' own), its
feed-forward block (a gated MLP, or routed experts with their router and an optional
shared expert) and how the residuals join them, each part naming the slots that hold
its weights.  :mod:`quill.layers.native_step` builds the one-call native decode step from
these descriptions alone, and names the layer and the reason for anything it cannot
run, so a new architecture either describes itself onto the native path or says why it
runs its Python layers.  The descriptions hold the model's modules; they copy nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from quill.layers.merged import MergedLinear
from quill.layers.slots import Linear, RMSNorm

# h = x + attention(input_norm(x)); out = h + ffn(post_attention_norm(h))  (Llama, Qwen, Mixtral)
PRE_NORM = "pre-norm"
# h = x + attention_out_norm(attention(input_norm(x))); out = h + ffn_out_norm(ffn(post_attention_norm(h)))
# (Gemma 3: a norm before and after each block)
SANDWICH_NORM = "sandwich-norm"
# softmax over the experts' logits, the top k, renormalized to sum 1 when asked
SOFTMAX_TOP_K = "softmax-top-k"


@dataclass(frozen=True)
class Projections:
    """Linear slots that read one input, under their checkpoint names (a merged group: q/k/v, gate/up)."""

    names: tuple[str, ...]
    group: MergedLinear


@dataclass(frozen=True)
class AttentionSpec:
    """Rotary self-attention with grouped KV heads through the layer's KV cache, scaled by ``scale``."""

    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    qkv: Projections  # q, k, v
    o_proj: Linear
    q_norm: RMSNorm | None = None  # per-head RMSNorm of q and k before the rotation (Qwen3)
    k_norm: RMSNorm | None = None
    # Qwen3.5: q_proj gives each head's query and a gate, out = o_proj(attn * sigmoid(gate))
    output_gate: bool = False
    rotary_dim: int | None = None  # channels of each head rotated (partial rotary); None: all of them
    # a local layer's sliding window: each token attends its last `window` positions, its own included
    # (transformers' `kv > q - window`); None: a global layer, the whole context
    window: int | None = None
    # gpt-oss: one learned logit per query head in the softmax denominator (a quill.layers Vector), or None
    sinks: object | None = None
    # Gemma 4: the values RMSNormed without a weight (this eps) before they are stored; None: no value norm
    value_norm_eps: float | None = None
    # Gemma 4's attention_k_eq_v: no v projection, the values are the keys before their norm and rope
    values_from_keys: bool = False
    # Gemma 4's KV-shared layers: the layer whose KV pool this one attends (written by it earlier in the step);
    # this layer has only q_proj (and q_norm) and writes no keys or values.  None: its own.
    kv_source: int | None = None

    @property
    def qkv_bias(self) -> bool:
        return any(p.has_bias for p in self.qkv.group.parts)

    @property
    def o_bias(self) -> bool:
        return self.o_proj.has_bias


@dataclass(frozen=True)
class MLPSpec:
    """Gated MLP: ``down(act(gate(x)) * up(x))``, ``act`` the config's ``hidden_act``."""

    gate_up: Projections
    down_proj: Linear
    activation: str
    intermediate: int


@dataclass(frozen=True)
class MoESpec:
    """Routed experts: ``router`` logits -> ``router_kind`` weights of ``top_k`` experts -> their gated MLPs,
    plus ``shared_expert`` (every token, scaled by ``sigmoid(shared_gate(x))``) when there is one."""

    name: str  # the block's checkpoint prefix (what reasons name)
    router: Linear
    router_kind: str
    top_k: int
    renormalize: bool
    native_group: object | None  # the routed experts as one native ExpertGroup, or None
    shared_expert: MLPSpec | None = None
    shared_gate: Linear | None = None
    activation: str = "silu"  # the experts' gated activation (quill.moe.config.gated_activation)

    @property
    def router_bias(self) -> bool:
        return self.router.has_bias


@dataclass(frozen=True)
class PerLayerInputSpec:
    """Gemma 4's per-layer input block, after the feed-forward residual:
    ``h = h + norm(projection(act(gate(h)) * u))``, ``u`` the layer's slice ``index`` of the model's per-token
    per-layer inputs [T, layers, width] (handed to the step with each call)."""

    gate: Linear  # [E] -> [width]
    projection: Linear  # [width] -> [E]
    norm: RMSNorm  # [E]
    activation: str
    index: int
    width: int


@dataclass(frozen=True)
class ExpertsBesideSpec:
    """Gemma 4's routed experts beside the dense MLP (``ffn``).  The router reads ``rms(h) * router_scale *
    router_mult`` (h the residual after attention, the norm weightless, eps ``router_eps``); its renormalized top-k
    weights are multiplied by ``expert_scale[expert]``; the experts read ``input_norm(h)``; the feed-forward output
    is ``mlp_out_norm(mlp) + out_norm(experts)`` (then the layer's ``ffn_out_norm`` and residual)."""

    moe: MoESpec  # the router, top-k, renormalization and the experts' native group
    input_norm: RMSNorm
    mlp_out_norm: RMSNorm
    out_norm: RMSNorm
    router_scale: object  # a quill.layers Vector [E]
    expert_scale: object  # a Vector [experts]
    router_eps: float
    router_mult: float


@dataclass(frozen=True)
class RecurrentSpec:
    """A Gated DeltaNet token mixer (quill.layers.deltanet) in place of attention: per-sequence conv and
    delta-rule state instead of a KV cache."""

    name: str  # the module's checkpoint name (what reasons name)
    layer: object  # the quill.layers.deltanet.GatedDeltaNet: its projections, conv weight, A_log, dt_bias, norm
    kind: str = "gated-deltanet"


@dataclass(frozen=True)
class DecoderLayerSpec:
    """One decoder layer: norms, attention, feed-forward block and the residual structure joining them."""

    input_norm: RMSNorm
    attention: AttentionSpec | RecurrentSpec
    post_attention_norm: RMSNorm  # the norm the feed-forward block reads (Llama's name for it)
    ffn: MLPSpec | MoESpec
    residual: str = PRE_NORM
    attention_out_norm: RMSNorm | None = None  # SANDWICH_NORM: the norms of the blocks' outputs
    ffn_out_norm: RMSNorm | None = None
    # the rotary table this layer's q and k turn by: "global", or "local" (Gemma 3's local layers' own base)
    rope: str = "global"
    per_layer_input: PerLayerInputSpec | None = None  # Gemma 4 (after the feed-forward residual)
    layer_scalar: object | None = None  # Gemma 4: the layer's output times this one-element Vector; None: 1
    experts_beside: ExpertsBesideSpec | None = None  # Gemma 4's MoE variant (with an MLPSpec ffn)
