"""quill against llama.cpp on random-weight Qwen3.5-shaped GGUF files (``qwen35`` dense, ``qwen35moe``), decode and
prefill tokens/s: ``llamacpp.py``'s comparison on the hybrid Gated DeltaNet / gated attention architecture.

    .venv/bin/python -m quill.bench.qwen35 --llama-python .venv-llamacpp/bin/python --out DIR
        [--models dense,moe] [--types q4_0,q4_k_m] [--write-only] [--act-quant none,int8,int8-group]
        [--isa avx2] [--llama-lib DIR] [--tiny] --json OUT

Each model is written once into ``--out`` as llama.cpp's converter writes a Qwen3.5 checkpoint with
``--outtype f16`` (the same metadata keys, tensor names, layouts and float types: norms, ``ssm_a``,
``ssm_dt.bias``, ``ssm_conv1d`` and the routers in F32, every other matrix in F16; the norms already as the
converter's ``1 + w``; the routers holding bfloat16 values, as a converted bf16 checkpoint's do;
tests/test_qwen3_5_gguf.py checks the writer against the converter's output for the same
configuration), with seeded random weights, then quantized by llama.cpp's own quantizer into each
``--types`` (``<name>.Q4_0.gguf``, ...); the F16 source is deleted after that unless ``--keep-f16``.  The
tokenizer is SmolLM2's (the default model's) with unused tokens up to Qwen3.5's 248,320-token vocabulary, so
the embedding and the tied lm_head have the real size; the prompt is fixed token ids (``llamacpp.prompt_ids``).

Shapes (``SHAPES``; the published configs' numbers as remembered, not read from the checkpoints: transformers'
Qwen3_5TextConfig defaults are the 9B's; the dense one's size agrees with the published 2B Q4_K_M file's):

* ``dense``: Qwen3.5-2B's text model (hidden 2048, 24 layers of which every 4th is full attention, MLP 6144,
  8 query / 2 KV heads of 256, DeltaNet 16 key / 16 value heads of 128, tied embeddings): 1.88B weights,
  F16 source 3.8 GB, Q4_K_M about 1.3 GB (the published Qwen3.5-2B-Q4_K_M.gguf: 1.28 GB);
* ``moe``: Qwen3.5-35B-A3B's layers (hidden 2048, 16 query / 2 KV heads of 256, DeltaNet 16 key / 32 value
  heads of 128, experts of 512, a shared expert of 512, 8 routed per token) with 16 layers and 32 experts
  (the real model: 40 and 256) so that it fits a small disk: 2.7B weights (F16 source 5.4 GB), 1.5B read
  per token.  llama.cpp needs equal DeltaNet key and value head dims (it reads both from ssm.state_size).

``--tiny`` writes the same files at test size (hidden 256, 4 layers) in seconds.  The JSON is llamacpp.py's
(``{"meta", "results"}``), each result with its ``shape`` and weight counts.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from quill.bench.llamacpp import add_modes_arg, bench_setup, compare, parse_modes, report
from quill.bench.random_gguf import TensorSpec, bf16_values, copy_tokenizer, quantize_source, uniform, write_gguf

QWEN35_VOCAB = 248320
MROPE_SECTIONS = [11, 11, 10, 0]  # the converter's default for Qwen3.5 (_Qwen35MRopeMixin)


@dataclass(frozen=True)
class Qwen35Shape:
    name: str
    hidden: int
    layers: int
    ffn: int  # the dense MLP (feed_forward_length; also written, unused, for the MoE)
    heads: int
    kv_heads: int
    head_dim: int
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    vocab: int = QWEN35_VOCAB
    tied: bool = True
    experts: int = 0  # 0: dense (qwen35)
    experts_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    conv_kernel: int = 4
    full_attention_interval: int = 4
    partial_rotary: float = 0.25
    rope_theta: float = 1e7
    context: int = 262144
    eps: float = 1e-6

    @property
    def arch(self) -> str:
        return "qwen35moe" if self.experts else "qwen35"

    def recurrent(self, i: int) -> bool:
        return bool((i + 1) % self.full_attention_interval)


SHAPES = {
    "dense": Qwen35Shape("qwen35-2b", hidden=2048, layers=24, ffn=6144, heads=8, kv_heads=2, head_dim=256,
                         lin_k_heads=16, lin_v_heads=16, lin_k_dim=128, lin_v_dim=128),
    "moe": Qwen35Shape("qwen35moe-2.7b-a1.5b", hidden=2048, layers=16, ffn=512, heads=16, kv_heads=2, head_dim=256,
                       lin_k_heads=16, lin_v_heads=32, lin_k_dim=128, lin_v_dim=128, experts=32, experts_used=8,
                       expert_ffn=512, shared_ffn=512),
}
# the same architectures at test size: every matrix a multiple of 256 wide, so K-quants need no fallback
TINY = {
    "dense": replace(SHAPES["dense"], name="qwen35-tiny", hidden=256, layers=4, ffn=512, heads=4, kv_heads=2,
                     head_dim=64, lin_k_heads=2, lin_v_heads=4, lin_k_dim=64, lin_v_dim=64, vocab=49152 + 256),
    "moe": replace(SHAPES["moe"], name="qwen35moe-tiny", hidden=256, layers=4, ffn=256, heads=4, kv_heads=2,
                   head_dim=64, lin_k_heads=2, lin_v_heads=4, lin_k_dim=64, lin_v_dim=64, experts=8, experts_used=2,
                   expert_ffn=256, shared_ffn=256, vocab=49152 + 256),
}


def tensor_specs(s: Qwen35Shape) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape, kept in F32) of every tensor, in the converter's order and layout."""
    h, conv_dim = s.hidden, 2 * s.lin_k_heads * s.lin_k_dim + s.lin_v_heads * s.lin_v_dim
    inner = s.lin_v_heads * s.lin_v_dim
    out = [] if s.tied else [("output.weight", (s.vocab, h), False)]
    out.append(("token_embd.weight", (s.vocab, h), False))
    for i in range(s.layers):
        p = f"blk.{i}."
        out.append((p + "attn_norm.weight", (h,), True))
        if s.recurrent(i):
            out += [(p + "ssm_a", (s.lin_v_heads,), True), (p + "ssm_conv1d.weight", (conv_dim, s.conv_kernel), True),
                    (p + "ssm_dt.bias", (s.lin_v_heads,), True), (p + "ssm_alpha.weight", (s.lin_v_heads, h), False),
                    (p + "ssm_beta.weight", (s.lin_v_heads, h), False), (p + "attn_qkv.weight", (conv_dim, h), False),
                    (p + "attn_gate.weight", (inner, h), False), (p + "ssm_norm.weight", (s.lin_v_dim,), True),
                    (p + "ssm_out.weight", (h, inner), False)]
        if s.experts:
            e, f, fs = s.experts, s.expert_ffn, s.shared_ffn
            out += [(p + "ffn_down_exps.weight", (e, h, f), False), (p + "ffn_gate_exps.weight", (e, f, h), False),
                    (p + "ffn_up_exps.weight", (e, f, h), False), (p + "ffn_gate_inp.weight", (e, h), True),
                    (p + "ffn_down_shexp.weight", (h, fs), False), (p + "ffn_gate_shexp.weight", (fs, h), False),
                    (p + "ffn_up_shexp.weight", (fs, h), False), (p + "ffn_gate_inp_shexp.weight", (1, h), True)]
        else:
            out += [(p + "ffn_down.weight", (h, s.ffn), False), (p + "ffn_gate.weight", (s.ffn, h), False),
                    (p + "ffn_up.weight", (s.ffn, h), False)]
        out.append((p + "post_attention_norm.weight", (h,), True))
        if not s.recurrent(i):
            q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
            out += [(p + "attn_k_norm.weight", (s.head_dim,), True), (p + "attn_k.weight", (kv, h), False),
                    (p + "attn_output.weight", (h, q), False), (p + "attn_q_norm.weight", (s.head_dim,), True),
                    (p + "attn_q.weight", (2 * q, h), False), (p + "attn_v.weight", (kv, h), False)]
    out.append(("output_norm.weight", (h,), True))
    return out


def weight_counts(s: Qwen35Shape) -> dict:
    """Weights in the file, and those a decoded token reads (the routed experts it uses, the lm_head)."""
    total = active = 0
    for name, shape, _ in tensor_specs(s):
        n = int(np.prod(shape))
        total += n
        if "_exps." in name:
            n = n * s.experts_used // s.experts
        if name != "token_embd.weight" or s.tied:
            active += n
    return {"weights": total, "weights_per_token": active}


def _metadata(w, s: Qwen35Shape, f32: bool) -> None:
    """The converter's keys (Qwen3_5TextModel / Qwen3_5MoeTextModel.set_gguf_parameters), in its order."""
    import gguf

    a = s.arch
    w.add_type("model")
    w.add_name(s.name)
    w.add_size_label(gguf.size_label(*w.get_total_parameter_count()))  # as the converter counts (tensors first)
    w.add_uint32(f"{a}.block_count", s.layers)
    w.add_uint32(f"{a}.context_length", s.context)
    w.add_uint32(f"{a}.embedding_length", s.hidden)
    w.add_uint32(f"{a}.feed_forward_length", s.ffn)
    w.add_uint32(f"{a}.attention.head_count", s.heads)
    w.add_uint32(f"{a}.attention.head_count_kv", s.kv_heads)
    w.add_float32(f"{a}.rope.freq_base", s.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", s.eps)
    if s.experts:
        w.add_uint32(f"{a}.expert_count", s.experts)
        w.add_uint32(f"{a}.expert_used_count", s.experts_used)
    w.add_uint32(f"{a}.attention.key_length", s.head_dim)
    w.add_uint32(f"{a}.attention.value_length", s.head_dim)
    w.add_uint32("general.file_type", gguf.LlamaFileType.ALL_F32 if f32 else gguf.LlamaFileType.MOSTLY_F16)
    if s.experts:
        w.add_uint32(f"{a}.expert_feed_forward_length", s.expert_ffn)
        w.add_uint32(f"{a}.expert_shared_feed_forward_length", s.shared_ffn)
    w.add_uint32(f"{a}.ssm.conv_kernel", s.conv_kernel)
    w.add_uint32(f"{a}.ssm.state_size", s.lin_k_dim)
    w.add_uint32(f"{a}.ssm.group_count", s.lin_k_heads)
    w.add_uint32(f"{a}.ssm.time_step_rank", s.lin_v_heads)
    w.add_uint32(f"{a}.ssm.inner_size", s.lin_v_heads * s.lin_v_dim)
    w.add_array(f"{a}.attention.recurrent_layers", [s.recurrent(i) for i in range(s.layers)])
    w.add_uint32(f"{a}.full_attention_interval", s.full_attention_interval)
    w.add_uint32(f"{a}.rope.dimension_count", int(s.head_dim * s.partial_rotary))
    w.add_array(f"{a}.rope.dimension_sections", MROPE_SECTIONS)
    w.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)


def _data(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random values that keep the forward finite: matrices uniform with the variance 1 / fan-in, norms as the
    converter stores them (1 + w), ``ssm_a = -exp(A_log)``."""
    leaf = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
    if leaf.endswith("norm"):
        return np.ones(shape, np.float32)
    if leaf.endswith("ssm_a"):
        return -np.exp(rng.uniform(-1.0, 1.5, shape)).astype(np.float32)
    x = uniform(rng, shape, 1.0 if leaf.endswith("ssm_dt") else shape[-1] ** -0.5)
    if leaf.endswith(ROUTERS):
        x = bf16_values(x)
    return x


# The MoE routers, F32 in the converter's output: a Qwen3.5 checkpoint is bfloat16, so they hold bfloat16 values,
# which quill runs on its native 16-bit dense kernel.  Random float32 values there kept them on torch, and with
# them every MoE decode off the native step, which no converted checkpoint does.
ROUTERS = ("ffn_gate_inp", "ffn_gate_inp_shexp")


def write_qwen35_gguf(out: Path, shape: Qwen35Shape, tokenizer_from: Path, seed: int = 0, f32: bool = False,
                      name: str | None = None) -> Path:
    """``out / name`` (default ``<shape.name>.F16.gguf``): the GGUF llama.cpp's converter writes for a Qwen3.5
    checkpoint of ``shape``, with random weights; written tensor by tensor (memory: the largest one), once."""
    path = out / (name or f"{shape.name}.{'F32' if f32 else 'F16'}.gguf")
    specs = [TensorSpec(n, t, np.float32 if f32 or keep_f32 else np.float16) for n, t, keep_f32 in tensor_specs(shape)]

    def metadata(w) -> None:
        _metadata(w, shape, f32)
        copy_tokenizer(w, tokenizer_from, shape.vocab)

    return write_gguf(path, shape.arch, specs, metadata, lambda rng, s: _data(rng, s.name, s.shape), seed)


def write_models(out: Path, models: list[str], types: list[str], llama_python: str, tokenizer_from: Path,
                 tiny: bool = False, keep_f16: bool = False, log=print) -> list[tuple[Path, Qwen35Shape]]:
    """Each model's F16 file, quantized by llama.cpp into each of ``types``: (quantized path, shape), in order."""
    files = []
    for m in models:
        shape = (TINY if tiny else SHAPES)[m]
        if shape.lin_k_dim != shape.lin_v_dim:  # llama.cpp reads both as ssm.state_size (Qwen3.5's are 128)
            raise ValueError(f"{shape.name}: llama.cpp runs Qwen3.5 only with equal DeltaNet key and value head dims")
        targets = {t: out / f"{shape.name}.{t.upper()}.gguf" for t in types}
        log(f"{shape.name}: {weight_counts(shape)['weights'] / 1e9:.3f}B weights")
        made = quantize_source(lambda: write_qwen35_gguf(out, shape, tokenizer_from), targets, llama_python,
                               keep_f16, log)
        files += [(p, shape) for p in made]
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-python", required=True, help="python of a virtualenv with llama-cpp-python")
    ap.add_argument("--out", type=Path, required=True, help="where the GGUF files are written (once)")
    ap.add_argument("--models", default="dense,moe", help="comma-separated: dense, moe")
    ap.add_argument("--types", default="q4_0,q4_k_m", help="llama.cpp ftypes to quantize each model into")
    ap.add_argument("--tiny", action="store_true", help="test-size shapes (hidden 256, 4 layers)")
    ap.add_argument("--keep-f16", action="store_true", help="keep the F16 files the quantizer reads")
    ap.add_argument("--write-only", action="store_true", help="write the files, run nothing")
    add_modes_arg(ap)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--isa", choices=("native", "avx2"), default="native", help="quill's (and torch's) ISA")
    ap.add_argument("--llama-lib", type=Path, default=None, help="directory of a native libllama.so to run")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    modes = parse_modes(ap, args.act_quant)
    if bad := set(models) - set(SHAPES):
        ap.error(f"unknown model(s) {', '.join(sorted(bad))}; known: {', '.join(SHAPES)}")
    if args.isa == "avx2":  # before torch is imported
        os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
    from quill.engine.hub import default_model

    files = write_models(args.out, models, args.types.split(","), args.llama_python, default_model(), args.tiny,
                         args.keep_f16)
    if args.write_only:
        return 0
    platform, threads, probe = bench_setup(args)
    results = []
    for f, shape in files:
        counts = weight_counts(shape)
        print(f"{f.name}: {counts['weights'] / 1e9:.2f}B weights ({counts['weights_per_token'] / 1e9:.2f}B read per "
              f"token); prompt {args.prompt}, {args.gen} decoded, {threads} threads", flush=True)
        res = compare(f, args.llama_python, args.prompt, args.gen, args.runs, threads, probe, print, platform,
                      args.llama_lib, args.kv_cache_dtype, modes=modes)
        results.append({**res, "shape": asdict(shape), **counts})
    report(results, args, platform, threads, "python -m quill.bench.qwen35", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
