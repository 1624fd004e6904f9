"""Every decoder layer of a decode step in one native call (``quill/native/csrc/step.cpp``).

A decode step of a small model spent more time around its kernels than in them: the
default model's 30 layers made ~60 Python module calls and ~500 torch ops per token
(~4 ms of a 12 ms token on the machines here), the kernels ~7.5 ms.  ``DecoderStep``
runs the same native functions the Python layers call (RMSNorm, the linears' kernels,
rope, the KV write, paged decode attention, SiLU-and-multiply, the residual adds) in
the same order on the same shapes, so its output is the Python path's bits
(tests/test_native_step.py compares them), with no Python in between.

The engine builds one at start-up when the model is a Llama-family decoder (llama,
qwen2, qwen3: the classes of :mod:`quill.models.llama`, Qwen3's q/k norms included;
the MoE decoders qwen3_moe and mixtral, whose routed experts run the native
ExpertGroup -- csrc/moe.cpp, the Python path's own call -- behind a native router)
in float32, every linear of every layer runs a native kernel, and decode attention is
native; otherwise :func:`build_native_step` says why not and the Python layers run.
It serves steps whose tokens are all decodes (one new token per sequence, the common
step); steps with a prompt chunk run the Python layers.  The step borrows the model's
kernels and the cache's pools: both live as long as the engine.
"""

from __future__ import annotations

import torch

from quill import native
from quill.engine.kv_cache import PagedKVCache, StepLayout
from quill.kernels import fused
from quill.kernels.linear import native_op
from quill.layers import SparseMoeBlock
from quill.models import llama, mixtral, qwen3

_ATTENTIONS = (llama.Attention, qwen3.Attention)
_LAYERS = (llama.DecoderLayer, mixtral.DecoderLayer)


class NativeDecodeStep:
    """``step(layout, h, rope) -> h``: every decoder layer of an all-decode step
    (what ``quill.models.base.ForwardContext.layers`` runs)."""

    def __init__(self, handle) -> None:
        self.handle = handle  # quill.native DecoderStep
        # one parallel region for the whole step (step.cpp); False: each op splits its own work (same bits)
        self.team = True

    def __call__(self, layout: StepLayout, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """h [1, T, E] (T decode tokens, one per sequence), rope cos/sin [1, T, D] -> [1, T, E]."""
        cos, sin = rope
        out = self.handle.forward(h[0].contiguous(), cos.contiguous(), sin.contiguous(), layout.slots,
                                  layout.decode_slots, layout.decode_lens, self.team)
        return out[None]


def build_native_step(model: torch.nn.Module, cache: PagedKVCache) -> tuple[NativeDecodeStep | None, str | None]:
    """The native decode step over ``model``'s layers and ``cache``'s pools, or (None, why not)."""
    ext = native.load().module
    if ext is None:
        return None, "native kernels unavailable"
    if cache.isa is None:
        return None, "decode attention runs in torch"
    if not isinstance(model, llama.Model):
        return None, f"{type(model).__name__} is not a Llama-family decoder"
    if model.dtype != torch.float32:
        return None, f"compute dtype {model.dtype} (the step runs float32)"
    args = model.args
    step = ext.DecoderStep(args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                           args.intermediate_size, args.head_dim ** -0.5, cache.isa)
    for i, layer in enumerate(model.model.layers):
        parts, why = _layer_parts(layer)
        if parts is None:
            return None, f"layer {i}: {why}"
        step.add_layer(**parts, k_pool=cache.keys[i], v_pool=cache.values[i])
    return NativeDecodeStep(step), None


def _layer_parts(layer) -> tuple[dict | None, str | None]:
    """What ``DecoderStep.add_layer`` takes from one decoder layer, or (None, why it cannot)."""
    if type(layer) not in _LAYERS:
        return None, f"{type(layer).__name__} is not a Llama or Mixtral decoder layer"
    attn = layer.self_attn
    mlp = layer.block_sparse_moe if isinstance(layer, mixtral.DecoderLayer) else layer.mlp
    if type(attn) not in _ATTENTIONS:
        return None, f"attention {type(attn).__name__} is not Llama's or Qwen3's"
    if type(mlp) is not SparseMoeBlock and (type(mlp) is not llama.MLP or mlp.act is not fused.silu_mul):
        return None, f"feed-forward {type(mlp).__name__} is neither a gated SiLU MLP nor routed SiLU experts"
    norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    qk_norms = [attn.q_norm.weight, attn.k_norm.weight] if isinstance(attn, qwen3.Attention) else [None, None]
    if any(w is not None and w.dtype != torch.float32 for w in norms + qk_norms):
        return None, "a norm weight is not float32"
    qkv, why = _linears(attn.qkv, ("q_proj", "k_proj", "v_proj"))
    if qkv is None:
        return None, why
    ffn, why = _moe_parts(mlp) if type(mlp) is SparseMoeBlock else _mlp_parts(mlp)
    if ffn is None:
        return None, why
    o, why = _linears_of([("o_proj", attn.o_proj.impl)])
    if o is None:
        return None, why
    return {
        "ln1": norms[0].contiguous(), "eps1": layer.input_layernorm.eps,
        "ln2": norms[1].contiguous(), "eps2": layer.post_attention_layernorm.eps,
        "qkv": qkv[0], "qkv_bias": qkv[1], "o": o[0][0], "o_bias": o[1][0], **ffn,
        "q_norm": qk_norms[0], "k_norm": qk_norms[1],
        "qk_eps": attn.q_norm.eps if isinstance(attn, qwen3.Attention) else 0.0,
    }, None


def _mlp_parts(mlp) -> tuple[dict | None, str | None]:
    gate_up, why = _linears(mlp.gate_up, ("gate_proj", "up_proj"))
    if gate_up is None:
        return None, why
    down, why = _linears_of([("down_proj", mlp.down_proj.impl)])
    if down is None:
        return None, why
    return {"gate_up": gate_up[0], "gate_up_bias": gate_up[1], "down": down[0][0], "down_bias": down[1][0]}, None


def _moe_parts(moe: SparseMoeBlock) -> tuple[dict | None, str | None]:
    """The router and the native expert group of an MoE block, or (None, why not)."""
    group = getattr(moe.fused.state, "group", None) if moe.fused is not None else None
    if group is None:
        return None, f"{moe.name}: the routed experts do not run as one native expert group"
    router, why = _linears_of([("router", moe.gate.impl)])
    if router is None:
        return None, why
    if router[1][0] is not None:
        return None, f"{moe.name}: the router has a bias"
    return {"gate_up": [], "gate_up_bias": [], "down": None, "down_bias": None, "router": router[0][0],
            "experts": group, "top_k": moe.top_k, "renormalize": moe.renormalize}, None


def _linears(group, names: tuple[str, ...]):
    """A merged group's one kernel, or its parts' kernels when they could not share one."""
    if group.impl is not None:
        return _linears_of([("+".join(names), group.impl)])
    return _linears_of([(n, p.impl) for n, p in zip(names, group.parts)])


def _linears_of(named: list[tuple[str, object]]):
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
