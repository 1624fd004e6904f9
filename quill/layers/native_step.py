"""Every decoder layer of a decode step in one native call (``quill/native/csrc/step.cpp``), built from
the layers' descriptions (:mod:`quill.layers.decoder`).

A decode step of a small model spent more time around its kernels than in them: the
default model's 30 layers made ~60 Python module calls and ~500 torch ops per token
(~4 ms of a 12 ms token on the machines here), the kernels ~7.5 ms.  ``DecoderStep``
runs the same native functions the Python layers call (RMSNorm, the linears' kernels,
rope, the KV write, paged decode attention, SiLU-and-multiply, the residual adds) in
the same order on the same shapes, so its output is the Python path's bits
(tests/test_native_step.py compares them), with no Python in between.

:func:`build_native_step` reads the model's ``DecoderLayerSpec`` list, never a model class.
It builds a step when the compute dtype is float32, decode attention is native, and every
layer is pre-norm or sandwich-norm (Gemma 3) with RMSNorms, a token mixer that is rotary
grouped-KV attention (q/k norms or not, biases or not, partial rotary or not, a sigmoid
output gate or not: Qwen3.5; attention sinks or not: gpt-oss; each layer turned by the rotary table its
spec names) or a
Gated DeltaNet (Qwen3.5's recurrent layers, over the engine's per-sequence state pools),
and either a gated SiLU / gelu-tanh MLP or softmax-top-k routed experts (a router bias or
not, a sigmoid-gated shared expert or not) that run as one native ExpertGroup (csrc/moe.cpp,
the Python path's own call, the experts' biases and activation its own: SiLU or gpt-oss's clamped
SwiGLU), every linear on a native kernel; otherwise it says why
(naming the layer) and the Python layers run.  The step serves steps whose tokens are all
decodes (one new token per sequence, the common step); steps with a prompt chunk run the
Python layers.  It borrows the model's kernels and the cache's and state pools' tensors:
all live as long as the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from quill import native
from quill.kernels.linear import native_op
from quill.layers.decoder import (
    PRE_NORM,
    SANDWICH_NORM,
    SOFTMAX_TOP_K,
    AttentionSpec,
    DecoderLayerSpec,
    MLPSpec,
    MoESpec,
    Projections,
    RecurrentSpec,
)

log = logging.getLogger("quill.layers")

# hidden_act names whose fused op the step runs (csrc/step.cpp: silu_mul, gelu_tanh_mul)
_NATIVE_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# rotary tables a model hands its layers (DecoderLayerSpec.rope); a model passing one (cos, sin) pair passes "global"
GLOBAL_ROPE = "global"
Rope = tuple[torch.Tensor, torch.Tensor]


class KVPools(Protocol):
    """What the step needs of the engine's paged KV cache (``quill.engine.kv_cache.PagedKVCache``)."""

    isa: str | None  # the native variant decode attention runs, None when it runs in torch
    keys: list[torch.Tensor]  # per layer [slots, Hkv, D]
    values: list[torch.Tensor]
    # layers whose pools are the sliding-window block group's (addressed through StepLayout.local)
    local_layers: frozenset[int]


class StatePools(Protocol):
    """What the step needs of the engine's recurrent-state pools (``quill.engine.state_cache.StatePool``)."""

    pools: dict[int, list[torch.Tensor]]  # layer -> its state parts, each [slots, *shape] (DeltaNet: conv, state)


class StepSlots(Protocol):
    """What the step reads of one step's layout (``quill.engine.kv_cache.StepLayout``)."""

    slots: torch.Tensor  # int64 [T]
    decode_slots: torch.Tensor  # int64 [T, Smax]
    decode_lens: torch.Tensor  # int64 [T]
    local: "StepSlots | None"  # the same in the sliding-window block group (None: no such group)


class NativeDecodeStep:
    """``step(layout, h, rope) -> h``: every decoder layer of an all-decode step
    (what ``quill.models.base.ForwardContext.layers`` runs)."""

    def __init__(self, handle, tables: Sequence[str] = (GLOBAL_ROPE,), states: Sequence[torch.Tensor] = ()) -> None:
        self.handle = handle  # quill.native DecoderStep
        self.tables = tuple(tables)  # the rotary tables' names, in the order the layers index them
        self.states = tuple(states)  # the recurrent layers' state pools the step updates in place
        # one parallel region for the whole step (step.cpp); False: each op splits its own work (same bits)
        self.team = True

    def __call__(self, layout: StepSlots, h: torch.Tensor, rope: Rope | Mapping[str, Rope],
                 state_rows: torch.Tensor | None = None, per_layer: torch.Tensor | None = None) -> torch.Tensor:
        """h [1, T, E] (T decode tokens, one per sequence), rope cos/sin [1, T, D] (or the model's tables by
        name, e.g. Gemma 3's {"global": ..., "local": ...}); state_rows int64 [T]: each token's sequence's
        recurrent-state slot (models with recurrent layers); per_layer [1, T, layers, P]: each token's per-layer
        inputs (Gemma 4, PerLayerInputSpec) -> [1, T, E]."""
        ropes = {GLOBAL_ROPE: rope} if isinstance(rope, tuple) else rope
        missing = [n for n in self.tables if n not in ropes]
        if missing:
            raise ValueError(f"native decode step: no rotary table {missing} (given {sorted(ropes)})")
        cos = [ropes[n][0].contiguous() for n in self.tables]
        sin = [ropes[n][1].contiguous() for n in self.tables]
        local = getattr(layout, "local", None)  # the sliding-window layers' tables
        tables = {} if local is None else {"local_slots": local.slots, "local_ctx_slots": local.decode_slots}
        if per_layer is not None:
            tables["per_layer"] = per_layer[0].float().contiguous()  # [T, layers, P]
        if not self.states:
            return self.handle.forward(h[0].contiguous(), cos, sin, layout.slots, layout.decode_slots,
                                       layout.decode_lens, self.team, **tables)[None]
        if self.team and self.handle.all_or_nothing(h.shape[1]):
            # the team path checks everything before it writes a state row and cannot fail after: no copies
            # (they were 2 x the states' bytes of memory traffic per step, ~48 MB for the Qwen3.5 MoE bench)
            return self.handle.forward(h[0].contiguous(), cos, sin, layout.slots, layout.decode_slots,
                                       layout.decode_lens, True, state_rows, **tables)[None]
        # the step updates the sequences' state rows in place: a step that fails leaves them as they were
        # (the engine retries request by request from the states a sequence had, quill.engine.state_cache)
        before = [pool.index_select(0, state_rows) for pool in self.states]
        try:
            out = self.handle.forward(h[0].contiguous(), cos, sin, layout.slots, layout.decode_slots,
                                      layout.decode_lens, self.team, state_rows, **tables)
        except BaseException:
            for pool, rows in zip(self.states, before):
                pool.index_copy_(0, state_rows, rows)
            raise
        return out[None]


def build_native_step(specs: Sequence[DecoderLayerSpec] | None, dtype: torch.dtype, pools: KVPools,
                      model: str = "the model", states: StatePools | None = None
                      ) -> tuple[NativeDecodeStep | None, str | None]:
    """The native decode step over the described layers, ``pools`` and (recurrent layers) ``states``, or
    (None, why not); either is logged once (``quill.layers``, the load log)."""
    step, why = _build(specs, dtype, pools, model, states)
    if step is None:
        log.info("native decode step: not built, the Python layers run (%s)", why)
    else:
        log.info("native decode step: %d decoder layers in one call", step.handle.num_layers)
    return step, why


def _build(specs: Sequence[DecoderLayerSpec] | None, dtype: torch.dtype, pools: KVPools,
           model: str, states: StatePools | None) -> tuple[NativeDecodeStep | None, str | None]:
    ext = native.load().module
    if ext is None:
        return None, "native kernels unavailable"
    if pools.isa is None:
        return None, "decode attention runs in torch"
    if specs is None:
        return None, f"{model} does not describe its decoder layers"
    if dtype != torch.float32:
        return None, f"compute dtype {dtype} (the step runs float32)"
    parts, held = [], []
    for i, spec in enumerate(specs):
        p, why = _layer_parts(spec)
        src = getattr(spec.attention, "kv_source", None)
        if p is not None and src is not None and not (0 <= src < i and _owns_kv(specs[src])):
            p, why = None, f"its keys and values are layer {src}'s, not an earlier layer computing its own"
        if p is not None and isinstance(spec.attention, RecurrentSpec):
            p, why = _mixer(ext, spec.attention, p, states.pools.get(i) if states is not None else None)
        if p is None:
            return None, f"layer {i}: {why}"
        parts.append(p)
        if "mixer" in p:
            held += states.pools[i]
    sizes, why = _sizes(specs)
    if sizes is None:
        return None, why
    tables = list(dict.fromkeys(s.rope for s in specs if isinstance(s.attention, AttentionSpec)))  # first use order
    step = ext.DecoderStep(*sizes, pools.isa)
    local = getattr(pools, "local_layers", frozenset())
    for i, (p, spec) in enumerate(zip(parts, specs)):
        attention = isinstance(spec.attention, AttentionSpec)
        rope = tables.index(spec.rope) if attention else 0
        src = spec.attention.kv_source if attention and spec.attention.kv_source is not None else i  # its pools
        step.add_layer(**p, k_pool=pools.keys[src], v_pool=pools.values[src], rope=rope, local=src in local)
    return NativeDecodeStep(step, tables, held), None


def _owns_kv(spec: DecoderLayerSpec) -> bool:
    return isinstance(spec.attention, AttentionSpec) and spec.attention.kv_source is None


def _sizes(specs: Sequence[DecoderLayerSpec]) -> tuple[tuple | None, str | None]:
    """(hidden, heads, kv heads, head dim, MLP intermediate, scale): the C++ step's sizes, the first attention
    layer's (each layer passes its own KV heads, head dim and intermediate: Gemma 4's differ); hidden size, heads
    and scale are one set for every layer, (None, what differs) otherwise."""
    def shape(s: DecoderLayerSpec) -> tuple:
        a = s.attention
        return s.input_norm.dim, a.heads, a.scale

    attention = [(i, s) for i, s in enumerate(specs) if isinstance(s.attention, AttentionSpec)]
    if not attention:
        return None, "no attention layers (the step sizes its buffers by them)"
    first = attention[0][1]
    for i, s in attention:
        if shape(s) != shape(first):
            return None, (f"layer {i}: hidden size, heads or scale differ from layer {attention[0][0]}'s "
                          "(one set per step)")
    dense = [s.ffn.intermediate for s in specs if isinstance(s.ffn, MLPSpec)]
    hidden, heads, scale = shape(first)
    a = first.attention
    # an all-MoE stack has no gated-MLP buffers to size: 1 is the step's smallest valid size
    return (hidden, heads, a.kv_heads, a.head_dim, dense[0] if dense else 1, scale), None


def _unsupported(spec: DecoderLayerSpec) -> str | None:
    """Why the step cannot compute what ``spec`` describes, whichever kernels its linears got (every reason,
    joined by "; ", so the load log names all a new architecture lacks); None: it can."""
    a, ffn, why = spec.attention, spec.ffn, []
    if isinstance(a, RecurrentSpec) and a.kind != "gated-deltanet":
        why.append(f"{a.name}: recurrent layer '{a.kind}' (the step runs gated-deltanet)")
    if isinstance(a, RecurrentSpec) and getattr(a.layer.conv1d, "bias", None) is not None:
        why.append(f"{a.name}: a conv bias (the step runs Qwen3.5's bias-free conv)")
    if spec.residual not in (PRE_NORM, SANDWICH_NORM):
        why.append(f"residual structure '{spec.residual}' (the step runs '{PRE_NORM}' and '{SANDWICH_NORM}')")
    if spec.residual == SANDWICH_NORM and (spec.attention_out_norm is None or spec.ffn_out_norm is None):
        why.append(f"residual structure '{SANDWICH_NORM}' without both output norms")
    rd = a.rotary_dim if isinstance(a, AttentionSpec) else None
    if rd is not None and not (0 < rd <= a.head_dim and rd % 2 == 0):
        why.append(f"partial rotary of {a.rotary_dim} of {a.head_dim} channels (the step turns an even count)")
    if isinstance(a, AttentionSpec) and a.kv_source is None and (a.q_norm is None) != (a.k_norm is None):
        why.append("a q norm without a k norm, or a k norm without a q norm (the step runs both or neither)")
    if isinstance(a, AttentionSpec) and a.kv_source is not None and (a.output_gate or a.sinks is not None):
        why.append("a KV-shared layer with an output gate or sinks (the step runs neither there)")
    ple = spec.per_layer_input
    if ple is not None and ple.activation not in _NATIVE_ACTIVATIONS:
        why.append(f"per-layer input activation '{ple.activation}' (the step runs {', '.join(_NATIVE_ACTIVATIONS)})")
    if isinstance(ffn, MLPSpec) and ffn.activation not in _NATIVE_ACTIVATIONS:
        why.append(f"feed-forward activation '{ffn.activation}' (the step runs {', '.join(_NATIVE_ACTIVATIONS)})")
    if isinstance(ffn, MoESpec) and ffn.router_kind != SOFTMAX_TOP_K:
        why.append(f"{ffn.name}: router '{ffn.router_kind}' (the step runs '{SOFTMAX_TOP_K}')")
    beside = spec.experts_beside
    if beside is not None and beside.moe.router_kind != SOFTMAX_TOP_K:
        why.append(f"{beside.moe.name}: router '{beside.moe.router_kind}' (the step runs '{SOFTMAX_TOP_K}')")
    if isinstance(ffn, MoESpec) and ffn.shared_expert is not None and ffn.shared_expert.activation != "silu":
        why.append(f"{ffn.name}: shared expert activation '{ffn.shared_expert.activation}' (the step runs silu)")
    if isinstance(ffn, MoESpec) and ffn.shared_expert is not None and ffn.shared_gate is None:
        why.append(f"{ffn.name}: a shared expert without its gate (the step runs sigmoid-gated shared experts)")
    return "; ".join(why) if why else None


def _layer_parts(spec: DecoderLayerSpec) -> tuple[dict | None, str | None]:
    """What ``DecoderStep.add_layer`` takes from one described layer, or (None, why it cannot)."""
    why = _unsupported(spec)
    if why is not None:
        return None, why
    attn = spec.attention
    recurrent = isinstance(attn, RecurrentSpec)
    sandwich = spec.residual == SANDWICH_NORM
    out_norms = [spec.attention_out_norm, spec.ffn_out_norm] if sandwich else [None, None]
    norms = [spec.input_norm.weight, spec.post_attention_norm.weight] + [n.weight for n in out_norms if n is not None]
    qk_norms = [None, None]
    if not recurrent:
        qk_norms = [None if n is None else n.weight for n in (attn.q_norm, attn.k_norm)]
    if spec.per_layer_input is not None:
        norms.append(spec.per_layer_input.norm.weight)
    if any(w is not None and w.dtype != torch.float32 for w in norms + qk_norms):
        return None, "a norm weight is not float32"
    sinks = None if recurrent or attn.sinks is None else attn.sinks.weight  # gpt-oss: [H], one per query head
    if sinks is not None and sinks.dtype != torch.float32:
        return None, "the attention sinks are not float32"
    qkv, why = ([], []), None  # a recurrent layer's in-projections are its mixer's (_mixer)
    if not recurrent:
        qkv, why = _group(attn.qkv)
    if qkv is None:
        return None, why
    ffn, why = _moe_parts(spec.ffn) if isinstance(spec.ffn, MoESpec) else _mlp_parts(spec.ffn)
    if ffn is None:
        return None, why
    o, why = _linears_of([("out_proj", attn.layer.out_proj.impl)] if recurrent else [("o_proj", attn.o_proj.impl)])
    if o is None:
        return None, why
    tail, why = _tail_parts(spec)
    if tail is None:
        return None, why
    beside, why = _beside_parts(spec)
    if beside is None:
        return None, why
    return {
        "ln1": norms[0].contiguous(), "eps1": spec.input_norm.eps,
        "ln2": norms[1].contiguous(), "eps2": spec.post_attention_norm.eps,
        "qkv": qkv[0], "qkv_bias": qkv[1], "o": o[0][0], "o_bias": o[1][0], **ffn,
        "q_norm": qk_norms[0], "k_norm": qk_norms[1], "qk_eps": 0.0 if recurrent else _qk_eps(attn),
        "window": 0 if recurrent else attn.window or 0,  # a local layer's sliding window (0: global)
        # sandwich norms (Gemma 3): each block's output normed before its residual
        "attn_out_norm": _weight(out_norms[0]), "attn_out_eps": out_norms[0].eps if sandwich else 0.0,
        "ffn_out_norm": _weight(out_norms[1]), "ffn_out_eps": out_norms[1].eps if sandwich else 0.0,
        "activation": spec.ffn.activation if isinstance(spec.ffn, MLPSpec) else "silu",
        # Qwen3.5: q_proj gives each head its query and an output gate; rotary over the first rotary_dim channels
        "output_gate": not recurrent and attn.output_gate, "rotary_dim": 0 if recurrent else attn.rotary_dim or 0,
        "sinks": None if sinks is None else sinks.contiguous(),
        # this layer's sizes (Gemma 4's local and global layers differ) and Gemma 4's attention
        **({} if recurrent else {
            "kv_heads": attn.kv_heads, "head_dim": attn.head_dim, "k_eq_v": attn.values_from_keys,
            "v_norm_eps": -1.0 if attn.value_norm_eps is None else attn.value_norm_eps,
            "kv_shared": attn.kv_source is not None}),
        **({"intermediate": spec.ffn.intermediate} if isinstance(spec.ffn, MLPSpec) else {}), **tail, **beside,
    }, None


def _beside_parts(spec: DecoderLayerSpec) -> tuple[dict | None, str | None]:
    """Gemma 4's experts beside the MLP ({} without them): the router and expert group, their norms and scales,
    or (None, why not)."""
    b = spec.experts_beside
    if b is None:
        return {}, None
    if not isinstance(spec.ffn, MLPSpec):
        return None, f"{b.moe.name}: experts beside routed experts (the step runs them beside a dense MLP)"
    if b.moe.shared_expert is not None:
        return None, f"{b.moe.name}: a shared expert beside the MLP's experts"
    moe, why = _moe_parts(b.moe)
    if moe is None:
        return None, why
    norms = [b.input_norm.weight, b.mlp_out_norm.weight, b.out_norm.weight, b.router_scale.weight,
             b.expert_scale.weight]
    return {k: moe[k] for k in ("router", "router_bias", "experts", "top_k", "renormalize")} | {
        "beside_norms": [w.float().contiguous() for w in norms],
        "beside_eps": [b.input_norm.eps, b.mlp_out_norm.eps, b.out_norm.eps, b.router_eps],
        "router_mult": b.router_mult}, None


def _tail_parts(spec: DecoderLayerSpec) -> tuple[dict | None, str | None]:
    """Gemma 4's layer tail: the per-layer input block and the layer scalar ({} without them), or (None, why)."""
    parts = {}
    if spec.layer_scalar is not None:
        parts["layer_scalar"] = float(spec.layer_scalar.weight.float().reshape(-1)[0])
    ple = spec.per_layer_input
    if ple is None:
        return parts, None
    linears, why = _linears_of([("per_layer_input_gate", ple.gate.impl), ("per_layer_projection", ple.projection.impl)])
    if linears is None:
        return None, why
    if any(b is not None for b in linears[1]):
        return None, "the per-layer input's linears have biases"
    return {**parts, "ple_gate": linears[0][0], "ple_proj": linears[0][1], "ple_norm": ple.norm.weight.contiguous(),
            "ple_eps": ple.norm.eps, "ple_index": ple.index, "ple_activation": ple.activation}, None


def _mixer(ext, spec: RecurrentSpec, parts: dict, pools: list[torch.Tensor] | None) -> tuple[dict | None, str | None]:
    """``parts`` with the native Gated DeltaNet mixer of a recurrent layer over its state ``pools`` (conv [N, C, K-1],
    delta-rule state [N, Hv, dk, dv]), or (None, why not)."""
    layer = spec.layer
    if pools is None or len(pools) != 2 or any(p.dtype != torch.float32 for p in pools):
        return None, f"{spec.name}: no float32 conv and delta-rule state pools from the engine"
    names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    proj, why = _group(Projections(names, layer.proj))
    if proj is None:
        return None, f"{spec.name}: {why}"
    tensors = [layer.conv1d.weight, layer.params["A_log"], layer.params["dt_bias"], layer.norm.weight]
    if any(t.dtype != torch.float32 for t in tensors):
        return None, f"{spec.name}: a conv, A_log, dt_bias or norm weight is not float32"
    mixer = ext.DeltaNetMixer(proj[0], proj[1], *(t.contiguous() for t in tensors), layer.norm.eps, pools[0],
                              pools[1], layer.d.tiled)
    return {**parts, "mixer": mixer}, None


def _weight(norm) -> torch.Tensor | None:
    return None if norm is None else norm.weight.contiguous()


def _qk_eps(attn: AttentionSpec) -> float:
    return attn.q_norm.eps if attn.q_norm is not None else 0.0


def _mlp_parts(mlp: MLPSpec) -> tuple[dict | None, str | None]:
    gate_up, why = _group(mlp.gate_up)
    if gate_up is None:
        return None, why
    down, why = _linears_of([("down_proj", mlp.down_proj.impl)])
    if down is None:
        return None, why
    return {"gate_up": gate_up[0], "gate_up_bias": gate_up[1], "down": down[0][0], "down_bias": down[1][0]}, None


def _moe_parts(moe: MoESpec) -> tuple[dict | None, str | None]:
    """The router (its bias or none) and the native expert group of an MoE block (the experts' biases and
    activation are the group's), or (None, why not)."""
    if moe.native_group is None:
        return None, f"{moe.name}: the routed experts do not run as one native expert group"
    router, why = _linears_of([("router", moe.router.impl)])
    if router is None:
        return None, why
    parts = {"gate_up": [], "gate_up_bias": [], "down": None, "down_bias": None, "router": router[0][0],
             "router_bias": router[1][0], "experts": moe.native_group, "top_k": moe.top_k,
             "renormalize": moe.renormalize}
    if moe.shared_expert is None:
        return parts, None
    shared, why = _mlp_parts(moe.shared_expert)  # routed + sigmoid(shared_gate(x)) * shared_expert(x)
    if shared is None:
        return None, f"{moe.name}: shared expert: {why}"
    gate, why = _linears_of([("shared_expert_gate", moe.shared_gate.impl)])
    if gate is None:
        return None, f"{moe.name}: {why}"
    if gate[1][0] is not None:
        return None, f"{moe.name}: the shared expert's gate has a bias"
    return {**parts, "shared_gate_up": shared["gate_up"], "shared_gate_up_bias": shared["gate_up_bias"],
            "shared_down": shared["down"], "shared_down_bias": shared["down_bias"], "shared_gate": gate[0][0],
            "shared_intermediate": moe.shared_expert.intermediate}, None


def _group(proj: Projections) -> tuple[tuple[list, list] | None, str | None]:
    """A merged group's one kernel, or its parts' kernels when they could not share one."""
    if proj.group.impl is not None:
        return _linears_of([("+".join(proj.names), proj.group.impl)])
    return _linears_of([(n, p.impl) for n, p in zip(proj.names, proj.group.parts)])


def _linears_of(named: list[tuple[str, object]]) -> tuple[tuple[list, list] | None, str | None]:
    """([C++ handle], [bias]) of built linears, or (None, why) when one does not run natively."""
    handles, biases = [], []
    for name, impl in named:
        op = native_op(impl)
        if op is None:
            kernel = getattr(impl, "kernel_name", type(impl).__name__)
            return None, f"{name} runs kernel {kernel}, not a native one"
        handles.append(op)
        biases.append(impl.bias)
    return (handles, biases), None
