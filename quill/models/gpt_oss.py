"""gpt-oss (HF ``model_type`` gpt_oss): a pre-norm decoder whose every feed-forward block is routed experts.

What differs from the Llama decoder (transformers' modeling_gpt_oss.py; llama.cpp's LLM_ARCH_OPENAI_MOE,
src/models/openai-moe-iswa.cpp, computes the same):

* attention sinks: each query head has a learned logit ``sinks[h]`` that joins the softmax denominator
  and is then dropped, so a head may attend to nothing (``softmax([q.k * scale, sink])[:-1]``);
* sliding-window layers (``layer_types``; by default every even layer, window 128) between full ones;
* YaRN rope as configured (transformers' default: factor 32 over 4096 positions, cos / sin scaled);
* q / k / v / o biases;
* the router has a bias; each token takes the ``num_experts_per_tok`` largest logits and softmaxes over
  those only (the same weights as softmax over all, top-k, renormalized);
* experts with biases and a clamped SwiGLU: gate clamped above at ``limit``, up to [-limit, limit],
  ``(up + 1) * gate * sigmoid(alpha * gate)`` (alpha 1.702, limit 7);
* HF checkpoints stack each projection of a layer's experts in one tensor (gate and up interleaved),
  split per expert on load (quill.layers.stacked_experts); GGUF files name each expert's rows;
  llm-compressor and auto-round write one linear per expert and projection.  GPTQModel does too, but its
  ``gate_proj`` / ``up_proj`` are the two halves of the interleaved fused projection (defuser's split), not the
  gate and up: a checkpoint whose ``quantization_config.meta.quantizer`` names gptqmodel has them regrouped
  (quill.layers.stacked_experts.ExpertHalves).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from quill.errors import ModelError
from quill.layers import SparseMoeBlock, attend, check_moe_config, expert_count, swiglu_clamped_name
from quill.layers.rope import apply_rope_qk
from quill.layers.stacked_experts import ExpertHalves, StackedExperts, Vector
from quill.models import llama
from quill.models.base import LayerCache

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' GptOssConfig default rope: YaRN over the 4096 positions gpt-oss was trained on
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


@dataclass
class ModelArgs(llama.ModelArgs):
    # transformers' GptOssConfig defaults where a config omits a field
    num_local_experts: int | None = None  # also spelt num_experts
    num_experts: int | None = None
    num_experts_per_tok: int = 4
    sliding_window: int | None = 128
    layer_types: list | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    rms_norm_eps: float = 1e-5
    head_dim: int | None = 64
    # set by from_dict: the checkpoint was quantized by GPTQModel, whose per-expert gate_proj / up_proj are the
    # halves of the fused gate_up projection (module docstring)
    experts_in_halves: bool = False

    @classmethod
    def from_dict(cls, params) -> "ModelArgs":
        args = super().from_dict(params)
        args.experts_in_halves = quantized_by_gptqmodel(params.get("quantization_config"))
        return args

    def __post_init__(self):
        if self.rope_parameters is None and self.rope_scaling is None:
            self.rope_parameters = dict(DEFAULT_ROPE)
        if self.rope_theta is None and not (self.rope_parameters or {}).get("rope_theta"):
            self.rope_theta = 150_000.0  # transformers' default base for gpt-oss
        # hidden_act says "silu" in gpt-oss configs; the experts run the clamped SwiGLU below whatever it says
        self.hidden_act = "silu"
        super().__post_init__()
        self.num_local_experts = expert_count(self.model_type, self.num_experts, self.num_local_experts, 128)
        self.num_experts = self.num_local_experts
        check_moe_config(self.model_type, self.num_hidden_layers, self.num_local_experts, self.num_experts_per_tok,
                         self.intermediate_size)
        for name in ("swiglu_alpha", "swiglu_limit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ModelError(f"config field '{name}': expected a positive number, found {v!r}")
        if self.layer_types is None:  # transformers' default: even layers slide, odd ones see everything
            self.layer_types = [SLIDING if (i + 1) % 2 else FULL for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {SLIDING, FULL}:
            raise ModelError(f"config field 'layer_types': expected {self.num_hidden_layers} entries of "
                             f"'{SLIDING}' / '{FULL}', found {self.layer_types!r}")

    def layer_window(self, layer: int) -> int | None:
        return super().layer_window(layer) if self.layer_types[layer] == SLIDING else None

    @property
    def expert_activation(self) -> str:
        return swiglu_clamped_name(self.swiglu_alpha, self.swiglu_limit)


class Attention(llama.Attention):
    """Llama attention (biases on q, k, v and o) with one sink logit per query head."""

    def __init__(self, args: ModelArgs, qkv_bias: bool, o_bias: bool):
        super().__init__(args, qkv_bias, o_bias)
        self.sinks = Vector(self.n_heads)

    def spec(self):
        return dataclasses.replace(super().spec(), sinks=self.sinks)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: LayerCache | None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project(x)  # [B, T, H, D]
        q, k = apply_rope_qk(q, k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        out = attend(q, k, v, cache, mask, self.scale, self.window, sinks=self.sinks.weight)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MoE(SparseMoeBlock):
    """Biased router (``router`` in HF names), top-k softmax, biased experts with the clamped SwiGLU; the
    checkpoint's stacked expert tensors arrive at ``stacked`` and fill the per-expert slots."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__(f"model.layers.{layer}.mlp", args.hidden_size, intermediate=args.intermediate_size,
                         num_experts=args.num_local_experts, top_k=args.num_experts_per_tok, renormalize=True,
                         hidden_act=args.expert_activation, router_bias=True, expert_bias=True)
        self.stacked = StackedExperts(args.num_local_experts, args.hidden_size, args.intermediate_size,
                                      self.deliver)
        self.halves = ExpertHalves(args.num_local_experts, args.hidden_size, args.intermediate_size, self.deliver,
                                   self.name)


class Model(llama.Model):
    """``GptOssForCausalLM``: tokens -> logits."""

    Attention = Attention
    checkpoint_aliases = (
        (r"(\.mlp)\.router\.", r"\1.gate."),  # the router is the MoE block's gate
        # stacked experts: the bias first (its name ends in _bias), then the weight or quantized layer
        (r"(\.mlp)\.experts\.(gate_up_proj|down_proj)_bias$", r"\1.stacked.\2.bias"),
        (r"(\.mlp)\.experts\.(gate_up_proj|down_proj)$", r"\1.stacked.\2"),
        (r"(\.self_attn\.sinks)$", r"\1.weight"),  # a bare parameter in HF, a vector slot here
    )

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32):
        super().__init__(args, dtype)
        if args.experts_in_halves:  # GPTQModel's experts.<e>.gate_proj / up_proj: halves, regrouped by the block
            self.checkpoint_aliases = ((r"(\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj)(?=\.|$)", r"\1.halves.\2.\3"),
                                       *type(self).checkpoint_aliases)

    def make_mlp(self, args: ModelArgs, layer: int) -> nn.Module:
        return MoE(args, layer)


def quantized_by_gptqmodel(qcfg) -> bool:
    """Whether a ``quantization_config`` says GPTQModel wrote the checkpoint (``meta.quantizer``: a list of
    "tool:version" strings, or one)."""
    meta = qcfg.get("meta") if isinstance(qcfg, dict) else None
    quantizer = meta.get("quantizer") if isinstance(meta, dict) else None
    names = quantizer if isinstance(quantizer, list) else [quantizer]
    return any(isinstance(q, str) and q.strip().lower().startswith("gptqmodel:") for q in names)
