"""What every model file shares: config parsing into ``ModelArgs``, the per-forward context, and the
base model class the engine talks to (``DecoderLM``: its native decode step, built by quill.layers from
the model's own description of its decoder layers)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from quill.errors import ModelError
from quill.layers import DecoderLayerSpec, KVPools, build_native_step


@dataclass
class BaseModelArgs:
    """A model's hyper-parameters, read from an HF ``config.json`` (unknown keys are dropped)."""

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> "BaseModelArgs":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = [n for n, f in fields.items()
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [n for n in required if params.get(n) is None]
        if missing:
            raise ModelError(f"config ({params.get('model_type', '?')}): required field(s) missing: "
                             f"{', '.join(missing)}")
        return cls(**{k: v for k, v in params.items() if k in fields and v is not None})

    def check_positive(self, *names: str) -> None:
        for n in names:
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ModelError(f"config field '{n}': expected a positive integer, found {v!r}")


class LayerCache(Protocol):
    """One layer's view of a KV cache (``quill.engine.kv_cache``; the model tests' ``tests/padded_cache.py``)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store the new tokens' k, v [B, Hkv, T, D]; attend q [B, H, T, D] over the cache -> [B, H, T, D]
        (``window``: a local layer's sliding window, each token attends its last ``window`` positions;
        ``sinks`` [H]: one learned logit per head in the softmax denominator, asked only by models with them)."""


@dataclass
class ForwardContext:
    """Everything one forward needs besides the tokens, passed explicitly down the layers.

    positions: int64 [B, T], the rotary position of each new token.
    mask: bool [B or 1, 1, T, S] (True = may attend), or None when every key is visible.
    caches: one LayerCache per decoder layer, or None (no cache: keys are the new tokens only).
    """

    positions: torch.Tensor
    mask: torch.Tensor | None
    caches: Sequence[LayerCache] | None = None
    logits_indices: torch.Tensor | None = None  # int64 [N]: the only flattened positions that need logits
    # runs every decoder layer at once in place of the model's loop: layers(h, rope) -> h (the engine's
    # native decode step, DecoderLM.native_decode_step); rope one (cos, sin), or the model's rotary tables by
    # the names its DecoderLayerSpec.rope use (Gemma 3: "global", "local"); None: the model's own layers run
    layers: Callable[[torch.Tensor, Any], torch.Tensor] | None = None

    @classmethod
    def causal(cls, batch: int, length: int) -> "ForwardContext":
        """A cache-less forward over whole sequences starting at position 0."""
        pos = torch.arange(length).expand(batch, length)
        mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
        return cls(pos, mask, None)

    def layer_cache(self, i: int) -> LayerCache | None:
        return None if self.caches is None else self.caches[i]


class DecoderLM(nn.Module):
    """A causal decoder-only model: tokens -> logits (``forward``), and what the engine asks besides."""

    dtype: torch.dtype  # the compute dtype

    def state_specs(self) -> list | None:
        """Per decoder layer the per-sequence state it keeps instead of keys and values
        (``quill.layers.deltanet.StateSpec``; None for a layer that uses the KV cache), or None: every
        layer uses the KV cache.  The engine allocates what this says and knows nothing else about it."""
        return None

    def kv_layer_shapes(self) -> list[tuple[int, int] | None] | None:
        """Per decoder layer the (kv heads, head dim) of its KV pool, None for a layer with no pool of its own
        (it reads another layer's, or keeps recurrent state); or None: every layer the config's
        (num_key_value_heads, head_dim), recurrent layers (``state_specs``) without."""
        return None

    def decoder_layer_specs(self) -> list[DecoderLayerSpec] | None:
        """Each decoder layer described (``quill.layers.decoder``), or None: this model does not describe its
        layers, so only its Python layers run."""
        return None

    def native_decode_step(self, cache: KVPools, states=None) -> tuple[Callable | None, str | None]:
        """Every decoder layer of an all-decode step in one native call over ``cache``'s pools and (recurrent
        layers) ``states``' pools (``quill.engine.state_cache.StatePool``), ``step(layout, h, rope, state_rows)
        -> h`` (``ForwardContext.layers``), or (None, why not, naming the layer)."""
        return build_native_step(self.decoder_layer_specs(), self.dtype, cache, type(self).__name__, states)
