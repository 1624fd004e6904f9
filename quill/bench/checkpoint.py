"""A Llama-shaped 4-bit checkpoint for the model-level benchmark (prefill/decode tokens/s).

Random weights quantized with round-to-nearest (:func:`quantize_rtn`) and written
as compressed-tensors pack-quantized (llm-compressor's W4A16 layout) through
quill's own format writer, so the benchmark needs no model hub.  Defaults match
Llama-3.2-1B's shapes: hidden 2048, MLP 8192, 32 heads of 64 (8 KV heads),
16 layers, vocabulary 128256.  By default the lm_head is a 4-bit layer of its own
(untied; the bfloat16 embedding is only looked up), so every linear a decoded
token reads is 4-bit; ``lm_head="tied"`` keeps Llama-3.2's tied bfloat16 head.
One safetensors shard per layer keeps memory bounded while writing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from quill.writers.compressed_tensors import (
    quantization_config,
    scheme_config,
    to_compressed_tensors,
)
from quill.writers.gptq import canonical_to_gptq
from quill.writers.rtn import quantize_rtn


@dataclass(frozen=True)
class LlamaShape:
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    num_hidden_layers: int = 16
    vocab_size: int = 128256

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def linears(self) -> dict[str, tuple[int, int]]:
        """Per-layer linear modules -> (out_features, in_features)."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_key_value_heads * self.head_dim
        return {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                "self_attn.o_proj": (h, h), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h),
                "mlp.down_proj": (h, i)}


def hf_config(shape: LlamaShape, quant: dict, tied: bool = True) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **asdict(shape), "head_dim": shape.head_dim,
        "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": tied, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
        "quantization_config": quant,
    }


def write_llama_w4(out: Path, layers: int = 16, group_size: int = 128, seed: int = 0,
                   shape: LlamaShape | None = None, lm_head: str = "w4", fmt: str = "compressed-tensors",
                   tokenizer_from: Path | None = None) -> Path:
    """Write the checkpoint directory ``out`` (config.json, one shard per layer, index); returns ``out``.

    ``lm_head``: "w4" (a 4-bit untied head, the default) or "tied" (the bfloat16 embedding).
    ``fmt``: "compressed-tensors" (pack-quantized) or "gptq" (v1 tensors, AutoGPTQ's config).
    ``tokenizer_from``: a checkpoint whose tokenizer is written beside the weights (its vocabulary
    size becomes the model's), so the checkpoint runs on text like a downloaded one.
    """
    if lm_head not in ("w4", "tied"):
        raise ValueError(f"lm_head '{lm_head}' is not supported; supported: w4, tied")
    if fmt not in ("compressed-tensors", "gptq"):
        raise ValueError(f"format '{fmt}' is not supported; supported: compressed-tensors, gptq")
    shape = shape or LlamaShape(num_hidden_layers=layers)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        shape = replace(shape, vocab_size=_write_tokenizer(Path(tokenizer_from), out))
    g = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    scheme = None

    def save(tensors: dict[str, torch.Tensor], fname: str) -> None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / fname))
        weight_map.update({k: fname for k in tensors})

    def quantized(name: str, n: int, k: int) -> dict[str, torch.Tensor]:
        nonlocal scheme
        w = torch.randn(n, k, generator=g) * (1.0 / k ** 0.5)
        qw = quantize_rtn(w, 4, group_size, symmetric=True, generator=g, scale_dtype=torch.bfloat16)
        qw = qw.with_(name=name)
        if fmt == "gptq":
            return {f"{name}.{s}": t for s, t in canonical_to_gptq(qw, write_g_idx=False).items()}
        scheme = scheme or scheme_config(qw)
        return {f"{name}.{s}": t for s, t in to_compressed_tensors(qw).items()}

    h = shape.hidden_size
    if lm_head == "w4":
        save(quantized("lm_head", shape.vocab_size, h), "model-lm-head.safetensors")
    save({"model.embed_tokens.weight": (torch.randn(shape.vocab_size, h, generator=g) * 0.02).to(torch.bfloat16),
          "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}, "model-embed.safetensors")
    for li in range(shape.num_hidden_layers):
        prefix = f"model.layers.{li}"
        tensors = {f"{prefix}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                   f"{prefix}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
        for module, (n, k) in shape.linears().items():
            tensors.update(quantized(f"{prefix}.{module}", n, k))
        save(tensors, f"model-layer{li:03d}.safetensors")
    if fmt == "gptq":
        quant = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": True, "desc_act": False,
                 "checkpoint_format": "gptq", "lm_head": lm_head == "w4"}
    else:
        quant = quantization_config({"group_0": scheme}, ignore=[] if lm_head == "w4" else ["lm_head"])
    (out / "config.json").write_text(json.dumps(hf_config(shape, quant, tied=lm_head == "tied"), indent=1))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def _write_tokenizer(source: Path, out: Path) -> int:
    """tokenizer.json and tokenizer_config.json of checkpoint ``source`` into ``out``; its vocabulary size."""
    from quill.formats.checkpoint import open_checkpoint
    spec = open_checkpoint(source).tokenizer_spec()
    spec.tokenizer.save(str(out / "tokenizer.json"))
    cfg = {**spec.special_tokens, "chat_template": spec.chat_template, "add_bos_token": spec.add_bos_token}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return spec.tokenizer.get_vocab_size()
