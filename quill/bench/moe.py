"""MoE benchmarks: one MoE layer, and a whole small MoE model written as a quantized checkpoint.

    python -m quill.bench.moe layer                  # Qwen3-30B-A3B expert shapes, decode and prefill
    python -m quill.bench.moe layer --tokens 1,32 --backends grouped,reference --experts 32
    python -m quill.bench.moe model /tmp/moe-w4      # writes the checkpoint first if the directory is empty
    (the same as ``quill bench moe-layer`` / ``quill bench moe-model`` where ``quill bench`` exists)

Bandwidth counts what a step has to read: for MoE layers only the experts its
tokens were routed to (each distinct expert once per step), as stored in the
checkpoint (packed codes plus scales); for the model, every other weight too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from quill.bench import memory, settled
from quill.bench.moe_args import MoEShape, add_arguments, register  # noqa: F401 (register: quill bench)
from quill.canonical import QuantizedWeight
from quill.errors import ConfigError, format_choices
from quill.kernels import KernelPolicy, KernelSelector
from quill.moe import MOE_BACKENDS, ExpertWeights, MoESelector, build_fused_moe, route
from quill.platform import Platform, detect
from quill.writers.compressed_tensors import (
    quantization_config,
    scheme_config,
    to_compressed_tensors,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # moe_args.DTYPE_NAMES, as torch dtypes


def random_weight(out: int, inp: int, bits: int, group: int, gen: torch.Generator, name: str) -> QuantizedWeight:
    """Random codes and scales (symmetric): the bytes and the arithmetic of a real checkpoint, no calibration."""
    codes = torch.randint(0, 1 << bits, (out, inp), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(out, inp // group, generator=gen) * 0.02 + 0.005) / inp ** 0.5 * 8
    return QuantizedWeight(codes, bits, group, scales.to(torch.bfloat16), name=name).validate()


def random_experts(shape: MoEShape, bits: int, group: int, seed: int = 0, layer: str = "mlp") -> list[ExpertWeights]:
    gen = torch.Generator().manual_seed(seed)
    return [ExpertWeights(*(random_weight(o, i, bits, group, gen, f"{layer}.experts.{e}.{p}")
                            for p, (o, i) in shape.expert().items())) for e in range(shape.num_experts)]


ROUTINGS = 32  # distinct routings a layer benchmark cycles through (experts read from DRAM, not L3)


def timed(fn: Callable[[], object], runs: int, min_run_s: float) -> float:
    """Median seconds per call over ``runs`` runs of at least ``min_run_s`` each (after one warm-up call)."""
    fn()
    per_call = []
    for _ in range(runs):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_run_s:
                break
        per_call.append(dt / n)
    return statistics.median(per_call)


# ---- one MoE layer ---------------------------------------------------------------------

def bench_layer(shape: MoEShape, bits: int, group: int, tokens: list[int], backends: list[str],
                dtype: torch.dtype, platform: Platform, runs: int = 3, min_run_s: float = 0.2,
                log: Callable[[str], None] = print, probe: memory.Probe | None = None) -> list[dict]:
    """Time one MoE layer per backend and token count; returns one row per (backend, tokens).

    With ``probe``, DRAM read probes are taken before and after every cell, and each row's
    ``roofline_pct`` is its GB/s against the highest any probe of the run read."""
    experts = random_experts(shape, bits, group)
    rows, probes = [], []
    for backend in backends:
        moe = build_fused_moe("bench.mlp", experts, shape.num_experts_per_tok,
                              MoESelector(platform, KernelPolicy(force=backend)),
                              KernelSelector(platform, KernelPolicy.from_env()), dtype=dtype)
        gen = torch.Generator().manual_seed(1)
        for T in tokens:
            x = torch.randn(T, shape.hidden_size, generator=gen).to(dtype)  # [T, H]
            # Calls cycle through ROUTINGS routings: one routing's experts (18.6 MiB for a
            # decode step of Qwen3-30B-A3B's shapes) would otherwise stay in L3 between calls.
            routings = [route(torch.randn(T, shape.num_experts, generator=gen), shape.num_experts_per_tok, True)
                        for _ in range(ROUTINGS)]
            turn = itertools.count()

            def call():
                weights, ids = routings[next(turn) % ROUTINGS]
                return moe(x, ids, weights)

            if probe is not None:
                probes.append(probe.best_gbs())
            s = timed(call, runs, min_run_s)
            if probe is not None:
                probes.append(probe.best_gbs())
            read = statistics.mean(moe.bytes_read(ids) for _, ids in routings)
            distinct = statistics.mean(len(set(ids.flatten().tolist())) for _, ids in routings)
            row = dict(backend=backend, tokens=T, ms=s * 1e3, tokens_per_s=T / s, gb_per_s=read / s / 1e9,
                       experts_read=distinct, mib_read=read / 2**20)
            rows.append(row)
            log(f"  {backend:<10} T={T:<5} {row['ms']:9.2f} ms  {row['tokens_per_s']:9.1f} tok/s  "
                f"{row['gb_per_s']:6.2f} GB/s  ({row['experts_read']:.1f} experts, {row['mib_read']:.1f} MiB per call)"
                + (f"  [DRAM probes {probes[-2]:.1f} / {probes[-1]:.1f} GB/s]" if probes else ""))
    if probes:
        best = max(probes)
        for row in rows:
            row["roofline_pct"] = 100 * row["gb_per_s"] / best
            row["roofline_gbs"] = best
        log(f"  % of roofline against the highest DRAM read of this run, {best:.1f} GB/s (probes {min(probes):.1f}-"
            f"{best:.1f}): " + ", ".join(f"{r['backend']} T={r['tokens']} {r['roofline_pct']:.0f} %" for r in rows))
    return rows


# ---- a whole MoE model -------------------------------------------------------------------

def hf_config(shape: MoEShape, quant: dict) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **asdict(shape),
        "intermediate_size": 6144, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
        "quantization_config": quant,
    }


def write_checkpoint(out: Path, shape: MoEShape, bits: int = 4, group: int = 128, seed: int = 0) -> Path:
    """A Qwen3-MoE checkpoint in compressed-tensors pack-quantized (llm-compressor's W4A16 layout).

    Attention and experts quantized; embeddings, norms, routers and lm_head in bf16 (as
    llm-compressor leaves them).  One safetensors shard per layer keeps writing memory bounded.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    scheme = None

    def save(tensors: dict[str, torch.Tensor], fname: str) -> None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / fname))
        weight_map.update({k: fname for k in tensors})

    h, v = shape.hidden_size, shape.vocab_size
    bf16 = torch.bfloat16
    save({"model.embed_tokens.weight": (torch.randn(v, h, generator=gen) * 0.02).to(bf16),
          "lm_head.weight": (torch.randn(v, h, generator=gen) / h ** 0.5).to(bf16),
          "model.norm.weight": torch.ones(h, dtype=bf16)}, "model-embed.safetensors")
    for li in range(shape.num_hidden_layers):
        p = f"model.layers.{li}"
        tensors = {f"{p}.input_layernorm.weight": torch.ones(h, dtype=bf16),
                   f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=bf16),
                   f"{p}.self_attn.q_norm.weight": torch.ones(shape.head_dim, dtype=bf16),
                   f"{p}.self_attn.k_norm.weight": torch.ones(shape.head_dim, dtype=bf16),
                   f"{p}.mlp.gate.weight": (torch.randn(shape.num_experts, h, generator=gen) / h ** 0.5).to(bf16)}
        modules = {f"{p}.self_attn.{m}": s for m, s in shape.attention().items()}
        modules.update({f"{p}.mlp.experts.{e}.{m}": s for e in range(shape.num_experts)
                        for m, s in shape.expert().items()})
        for module, (o, i) in modules.items():
            qw = random_weight(o, i, bits, group, gen, module)
            scheme = scheme or scheme_config(qw)
            tensors.update({f"{module}.{k}": t for k, t in to_compressed_tensors(qw).items()})
        save(tensors, f"model-layer{li:03d}.safetensors")
    quant = quantization_config({"group_0": scheme}, ignore=["lm_head", "re:.*mlp.gate$"])
    (out / "config.json").write_text(json.dumps(hf_config(shape, quant), indent=1))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def bench_model(path: Path, prompt_len: int, gen_tokens: int, dtype: str, threads: int | None,
                log: Callable[[str], None] = print, probe: memory.Probe | None = None) -> dict:
    """Load ``path`` with quill.LLM and time a prefill of ``prompt_len`` tokens and ``gen_tokens`` decode steps
    (with ``probe``: DRAM read probes just before and after, and the decode's % of the higher)."""
    import quill
    from quill.layers import SparseMoeBlock

    t0 = time.perf_counter()
    llm = settled(quill.LLM(str(path), skip_tokenizer_init=True, dtype=dtype, threads=threads))
    load_s = time.perf_counter() - t0
    blocks = [m for m in llm.model.modules() if isinstance(m, SparseMoeBlock)]
    expert_bytes = sum(sum(b.fused.expert_bytes) / len(b.fused.expert_bytes) * b.top_k for b in blocks)
    other_bytes = sum(i.weight_bytes for i in llm.loaded.layers if i.kind not in ("expert", "tied", "embedding"))
    all_experts = sum(sum(b.fused.expert_bytes) for b in blocks)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(4, llm.model.args.vocab_size, (prompt_len,), generator=gen).tolist()
    params = quill.SamplingParams(max_tokens=gen_tokens, temperature=0, ignore_eos=True)
    llm.generate([prompt[:8]], quill.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm-up
    probes = [probe.best_gbs()] if probe is not None else []
    t = llm.generate([prompt], params)[0].timings
    probes += [probe.best_gbs()] if probe is not None else []
    step = expert_bytes + other_bytes  # bytes one decode step (batch 1) reads
    row = dict(load_s=load_s, prefill_tokens=prompt_len, prefill_tokens_per_s=t.prefill_tps,
               decode_tokens=gen_tokens, decode_tokens_per_s=t.decode_tps,
               decode_gb_per_s=step * t.decode_tps / 1e9, step_mib=step / 2**20,
               routed_expert_mib=expert_bytes / 2**20, other_mib=other_bytes / 2**20,
               all_experts_mib=all_experts / 2**20,
               backends=sorted({b.fused.backend_name for b in blocks}),
               kernels=sorted({i.kernel for i in llm.loaded.layers if i.kind == "quantized"}))
    if probes:
        row.update(dram_probes_gbs=probes, roofline_pct=100 * row["decode_gb_per_s"] / max(probes))
    log(f"  load {load_s:.1f} s; prefill {prompt_len} tokens: {t.prefill_tps:.1f} tok/s; decode {gen_tokens} tokens: "
        f"{t.decode_tps:.2f} tok/s, {row['decode_gb_per_s']:.2f} GB/s"
        + (f" ({row['roofline_pct']:.0f} % of the higher DRAM probe, {probes[0]:.1f} before / {probes[1]:.1f} after)"
           if probes else ""))
    log(f"  one decode step reads {row['step_mib']:.1f} MiB: routed experts {row['routed_expert_mib']:.1f} MiB "
        f"(of {row['all_experts_mib']:.0f} MiB of experts), everything else {row['other_mib']:.1f} MiB; "
        f"MoE backend {', '.join(row['backends'])}, linear kernels {', '.join(row['kernels'])}")
    return row


# ---- command line ---------------------------------------------------------------------------

def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise ConfigError(f"--{what} '{text}' should be comma-separated integers") from e


def _shape(args) -> MoEShape:
    return MoEShape(hidden_size=args.hidden, moe_intermediate_size=args.inter, num_experts=args.experts,
                    num_experts_per_tok=args.top_k, num_hidden_layers=getattr(args, "layers", 4))


def _header(args, platform: Platform) -> int:
    threads = args.threads or platform.default_threads
    torch.set_num_threads(threads)
    print(f"cpu: {platform.model_name} ({platform.microarch}, {platform.isa_level}), {threads} threads, "
          f"torch {torch.__version__}", flush=True)
    return threads


def run_layer(args) -> int:
    platform = detect().limited_to(args.isa)
    _header(args, platform)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in MOE_BACKENDS]
    if unknown:
        raise ConfigError(f"unknown MoE backend(s) {', '.join(unknown)}; known: {format_choices(MOE_BACKENDS)}")
    shape = _shape(args)
    print(f"MoE layer: {shape.num_experts} experts, top-{shape.num_experts_per_tok}, hidden {shape.hidden_size}, "
          f"expert intermediate {shape.moe_intermediate_size}, W{args.bits} g{args.group}, {args.dtype}", flush=True)
    threads = args.threads or platform.default_threads
    probe = memory.Probe(platform.cache("L3") or (32 << 20), threads)
    rows = bench_layer(shape, args.bits, args.group, _ints(args.tokens, "tokens"), backends, DTYPES[args.dtype],
                       platform, runs=args.runs, log=lambda s: print(s, flush=True), probe=probe)
    if args.json:
        args.json.write_text(json.dumps({"shape": asdict(shape), "rows": rows}, indent=1))
    return 0


def run_model(args) -> int:
    platform = detect()
    threads = _header(args, platform)
    shape = _shape(args)
    if not (args.path / "config.json").is_file():
        print(f"writing {args.path} ({shape.num_hidden_layers} layers, {shape.num_experts} experts)", flush=True)
        write_checkpoint(args.path, shape, args.bits, args.group)
    probe = memory.Probe(platform.cache("L3") or (32 << 20), threads)
    row = bench_model(args.path, args.prompt, args.gen, args.dtype, threads, lambda s: print(s, flush=True), probe)
    if args.json:
        args.json.write_text(json.dumps(row, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quill.bench.moe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    add_arguments(sub.add_parser("layer", help="time one MoE layer (decode and prefill)"),
                  sub.add_parser("model", help="time a small quantized MoE model end to end"))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
