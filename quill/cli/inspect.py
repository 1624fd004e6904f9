"""``quill inspect``: how a checkpoint loads: per layer format and kernel, totals, and load memory."""

from __future__ import annotations

import re
from dataclasses import replace

from quill.cli.common import add_model_args, build_llm

MB = 1024 * 1024


def register(sub) -> None:
    p = sub.add_parser("inspect", help="show each layer's quantization and chosen kernel, and load memory")
    add_model_args(p, positional="optional")  # the default model when none is given, as everywhere
    p.set_defaults(func=run)


def report(llm) -> str:
    loaded, args = llm.loaded, llm.model.args
    lines = [
        f"model:      {llm.path}",
        f"format:     {loaded.checkpoint.describe()}",
        f"arch:       {args.model_type}: {args.num_hidden_layers} layers, hidden {args.hidden_size}, heads "
        f"{args.num_attention_heads}/{args.num_key_value_heads} x {args.head_dim}, vocab {args.vocab_size}, "
        f"context {llm.context_length}, tied embeddings {'yes' if args.tie_word_embeddings else 'no'}",
        f"cpu:        {llm.platform.microarch} ({llm.platform.isa_level}), {llm.threads} threads, "
        f"compute {str(loaded.dtype).removeprefix('torch.')}",
        *(f"{k + ':':<11} {v}" for k, v in llm.arithmetic.items()),  # activations and KV cache: what and why
        f"decode step: {_step(llm.engine)}",
        *_moe_decode(llm.model),
        "",
        f"{'layer':<44} {'kind':<9} {'bits':>4} {'group':>6} {'sym':>4}  {'kernel':<12} weights",
    ]
    for i, count in _collapse_experts(loaded.layers):
        bits = "-" if i.bits is None else str(i.bits)
        group = "-" if i.group_size is None else ("ch" if "ch " in i.summary else str(i.group_size))
        sym = "-" if i.symmetric is None else ("yes" if i.symmetric else "no")
        kind = i.kind if count == 1 else f"{i.kind} x{count}"
        lines.append(f"{i.name:<44} {kind:<9} {bits:>4} {group:>6} {sym:>4}  {i.kernel:<12} {i.summary}")
        for name, why in i.refusals:
            lines.append(f"{'':<46}skipped {name}: {why}")
    n, nbytes = loaded.num_weights, loaded.weight_bytes
    m = loaded.memory
    lines += [
        "",
        f"weights:        {n:,} ({nbytes / MB:.1f} MiB as stored, {nbytes / max(n, 1):.3f} bytes = "
        f"{8 * nbytes / max(n, 1):.2f} bits per weight)",
        f"load memory:    peak +{m.peak / MB:.1f} MiB, resident +{m.resident / MB:.1f} MiB; bound 1.3 x resident "
        f"+ one layer ({m.largest_layer / MB:.1f} MiB) = {m.bound / MB:.1f} MiB: "
        f"{'within' if m.within_bound else 'OVER'}" + ("" if m.peak_reset else " (peak includes pre-load use)"),
    ]
    return "\n".join(lines)


def _step(engine) -> str:
    """How a decode step runs its layers (the model's native_decode_step, quill.layers.native_step), or why
    not in one native call (the layer and the reason)."""
    if engine.native_step is not None:
        return "native: every decoder layer in one call"
    return f"the model's Python layers ({engine.native_step_reason})"


def _moe_decode(model) -> list[str]:
    """How each MoE layer runs its routed experts (quill.moe.grouped), for MoE models."""
    from quill.layers import SparseMoeBlock

    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return []
    grouped = sum(getattr(b.fused.state, "group", None) is not None for b in blocks)
    return [f"moe experts: {grouped} of {len(blocks)} MoE layers run their routed experts in one native call"
            + ("" if grouped == len(blocks) else " (the others: one call per expert projection)")]


def _collapse_experts(layers):
    """(info, count) rows: an MoE layer's experts become one row per projection and format, named ``experts.*``."""
    rows: dict = {}
    for i in layers:
        if i.kind != "expert":
            rows[i.name] = [i, 1]
            continue
        name = re.sub(r"\.experts\.\d+\.", ".experts.*.", i.name)
        key = (name, i.summary, i.kernel)
        if key in rows:
            rows[key][1] += 1
        else:
            rows[key] = [replace(i, name=name), 1]
    return [tuple(r) for r in rows.values()]


def run(args) -> int:
    llm = build_llm(args, skip_tokenizer_init=True)
    print(report(llm))
    return 0
