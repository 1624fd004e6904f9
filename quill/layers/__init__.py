"""The one seam between model files and kernels.

Model files import this package only: slots the loader fills by name (linear,
embedding, norm, MoE experts), rotary embeddings, attention and the fused ops,
and the descriptions of their decoder layers (:mod:`quill.layers.decoder`) from
which :func:`build_native_step` builds the one-call native decode step.
Which kernel runs a slot, on which ISA, from which format, is decided here at
load (through :class:`LoadContext`) and never seen by a model or the engine.
"""

from quill.layers.context import LayerInfo, LoadContext
from quill.layers.decoder import (
    SANDWICH_NORM,
    AttentionSpec,
    DecoderLayerSpec,
    ExpertsBesideSpec,
    MLPSpec,
    MoESpec,
    PerLayerInputSpec,
    Projections,
)
from quill.layers.merged import MergedLinear, merged
from quill.layers.moe import (
    ExpertSlot,
    SharedExpertMoeBlock,
    SparseMoeBlock,
    check_moe_config,
    expert_count,
    is_sparse_layer,
    route,
    swiglu_clamped_name,
)
from quill.layers.native_step import KVPools, NativeDecodeStep, build_native_step
from quill.layers.ops import (
    ACTIVATIONS,
    attend,
    attention,
    paged_decode_attention,
    paged_prefill_attention,
    sigmoid,
    unit_rms_norm,
)
from quill.layers.rope import RopeConfig, RotaryEmbedding, apply_rope_q, apply_rope_qk, rope_inv_freq
from quill.layers.slots import Embedding, Linear, PostLoad, RMSNorm, Slot, linear, take_rows

__all__ = [
    "ACTIVATIONS", "Embedding", "ExpertSlot", "LayerInfo", "Linear", "LoadContext", "MergedLinear", "PostLoad",
    "RMSNorm", "SANDWICH_NORM", "merged",
    "AttentionSpec", "DecoderLayerSpec", "ExpertsBesideSpec", "KVPools", "MLPSpec", "MoESpec", "NativeDecodeStep",
    "PerLayerInputSpec", "Projections",
    "build_native_step",
    "RopeConfig", "RotaryEmbedding", "SharedExpertMoeBlock", "Slot", "SparseMoeBlock", "apply_rope_q", "apply_rope_qk",
    "attend",
    "attention", "paged_decode_attention", "paged_prefill_attention",
    "check_moe_config", "expert_count", "is_sparse_layer", "linear", "rope_inv_freq", "route", "sigmoid",
    "swiglu_clamped_name", "take_rows", "unit_rms_norm",
]
