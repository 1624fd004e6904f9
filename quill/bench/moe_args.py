"""The MoE benchmarks' options and shapes, without torch: ``quill bench --help`` lists them without loading it.

The runs themselves are in ``quill.bench.moe`` (imported when one starts).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from quill.platform import ISA_CHOICES

DTYPE_NAMES = ("bfloat16", "float32")
BACKEND_NAMES = ("grouped", "reference")  # quill.moe.MOE_BACKENDS' keys (tests/test_bench_moe.py checks)


@dataclass(frozen=True)
class MoEShape:
    """Qwen3-30B-A3B's shapes, with fewer layers and a smaller vocabulary (so the experts dominate)."""

    hidden_size: int = 2048
    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    num_hidden_layers: int = 4
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    vocab_size: int = 8192

    def attention(self) -> dict[str, tuple[int, int]]:
        """Per-layer attention projections -> (out_features, in_features)."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}

    def expert(self) -> dict[str, tuple[int, int]]:
        h, i = self.hidden_size, self.moe_intermediate_size
        return {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}



def add_arguments(layer: argparse.ArgumentParser, model: argparse.ArgumentParser) -> None:
    for p in (layer, model):
        p.add_argument("--threads", type=int, default=None, help="threads (default: the usable physical cores)")
        p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32", help="compute dtype")
        p.add_argument("--hidden", type=int, default=MoEShape.hidden_size)
        p.add_argument("--inter", type=int, default=MoEShape.moe_intermediate_size, help="expert intermediate size")
        p.add_argument("--experts", type=int, default=MoEShape.num_experts)
        p.add_argument("--top-k", type=int, default=MoEShape.num_experts_per_tok)
        p.add_argument("--bits", type=int, default=4, choices=(4, 8))
        p.add_argument("--group", type=int, default=128)
        p.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    layer.add_argument("--tokens", default="1,16,128", help="token counts per call (default 1,16,128)")
    layer.add_argument("--backends", default="grouped", help=f"MoE backends ({', '.join(BACKEND_NAMES)})")
    layer.add_argument("--runs", type=int, default=3, help="timed runs per cell; the median is reported")
    layer.add_argument("--isa", choices=ISA_CHOICES, default="native",
                       help="'avx2': the kernel variants of an AVX2-only CPU (Zen 2/3)")
    model.add_argument("path", type=Path, help="checkpoint directory (written first when it has no config.json)")
    model.add_argument("--layers", type=int, default=MoEShape.num_hidden_layers)
    model.add_argument("--prompt", type=int, default=128, help="prompt tokens (prefill)")
    model.add_argument("--gen", type=int, default=32, help="generated tokens (decode)")
    layer.set_defaults(func=_later("run_layer"))
    model.set_defaults(func=_later("run_model"))


def register(bsub) -> None:
    """Add ``moe-layer`` and ``moe-model`` to a ``quill bench`` subparser set."""
    add_arguments(bsub.add_parser("moe-layer", help="time one MoE layer (decode and prefill)"),
                  bsub.add_parser("moe-model", help="time a small quantized MoE model end to end"))


def _later(name: str):
    """``quill.bench.moe.<name>``, imported when the benchmark runs (it imports torch)."""
    def run(args) -> int:
        from quill.bench import moe
        return getattr(moe, name)(args)
    return run
