"""Random-weight GGUF files of two sliding-window architectures, laid out as llama.cpp's tools leave them: the
files quill.bench.windowed compares the engines on.

* ``gemma3``: Gemma-3-1B's text model, written as llama.cpp's converter writes a Gemma 3 checkpoint with
  ``--outtype f16`` (the same keys in the same order, tensor names, order, shapes and float types: norms F32
  and stored as the converter's ``1 + w``, matrices F16; the embedding tied), then quantized by llama.cpp's
  own quantizer (Q4_0: the type of Google's QAT GGUF; Q4_K_M).
* ``gpt-oss``: gpt-oss-20b, written directly as llama.cpp's ``MXFP4_MOE`` quantization of a converted
  checkpoint leaves it (an F16 source would be ~42 GB): the experts MXFP4 (random E2M1 codes, E8M0 scales
  around the 1 / sqrt(fan-in) standard deviation), every other 2-D weight Q8_0 (random int8 codes in
  [-127, 127], as ggml's rounding gives, and one f16 scale), norms, biases, sinks and the router F32
  (bfloat16 values, as a converted bf16 checkpoint's); tensors in the quantizer's order (``llama-quant.cpp``
  writes them as the model loader's map sorts them: unnumbered first, then layer by layer, by name).

tests/test_windowed_gguf.py checks both against the converter and the quantizer run on a transformers model of
the same configuration (keys, value types and values, tensor names, order, types and shapes).  The shapes are
the published configs' (google/gemma-3-1b-it, openai/gpt-oss-20b: transformers' Gemma3TextConfig and
GptOssConfig defaults are other sizes), the vocabulary padded from SmolLM2's tokenizer to theirs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from quill.bench.random_gguf import TensorSpec, bf16_values, copy_tokenizer, quantize_source, uniform, write_gguf

SMOLLM2_VOCAB = 49152


@dataclass(frozen=True)
class Gemma3Shape:
    name: str
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    window: int  # every layer but each 6th slides (llama.cpp's fixed pattern; the file does not say it)
    vocab: int = 262144
    context: int = 32768
    rope_theta: float = 1e6  # the global layers'
    rope_local: float = 1e4
    eps: float = 1e-6
    arch: str = "gemma3"


@dataclass(frozen=True)
class GptOssShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_used: int
    expert_ffn: int
    window: int  # on layers 0, 2, 4, ...
    vocab: int = 201088
    context: int = 131072
    rope_theta: float = 150000.0
    yarn_factor: float = 32.0
    yarn_original_context: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    eps: float = 1e-5
    arch: str = "gpt-oss"


SHAPES = {
    "gemma3": Gemma3Shape("gemma3-1b", hidden=1152, layers=26, ffn=6912, heads=4, kv_heads=1, head_dim=256,
                          window=512),
    "gpt-oss": GptOssShape("gpt-oss-20b", hidden=2880, layers=24, heads=64, kv_heads=8, head_dim=64, experts=32,
                           experts_used=4, expert_ffn=2880, window=128),
}
# test size, in seconds: Gemma's hidden 384 is, like 1152, no multiple of 256 (Q4_K_M falls back on the same
# tensors); 7 layers: local, global (the 6th) and local again; windows shorter than the tests' prompts
TINY = {
    "gemma3": replace(SHAPES["gemma3"], name="gemma3-tiny", hidden=384, layers=7, ffn=768, window=32,
                      vocab=SMOLLM2_VOCAB + 256),
    "gpt-oss": replace(SHAPES["gpt-oss"], name="gpt-oss-tiny", hidden=256, layers=4, heads=8, kv_heads=2,
                       experts=8, experts_used=2, expert_ffn=256, window=32, vocab=SMOLLM2_VOCAB + 256),
}
GEMMA3_TYPES = ("q4_0", "q4_k_m")
GPT_OSS_TYPE = "MXFP4_MOE"  # what the file name says; written directly, never by the quantizer


def gemma3_specs(s: Gemma3Shape, f32: bool = False) -> list[TensorSpec]:
    """The converter's tensors for a Gemma 3 text checkpoint, in its order (``--outtype f16``, or f32)."""
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    mat, vec = (np.float32 if f32 else np.float16), np.float32
    out = [TensorSpec("token_embd.weight", (s.vocab, h), mat)]
    for i in range(s.layers):
        p = f"blk.{i}."
        out += [TensorSpec(p + "attn_norm.weight", (h,), vec), TensorSpec(p + "ffn_down.weight", (h, s.ffn), mat),
                TensorSpec(p + "ffn_gate.weight", (s.ffn, h), mat), TensorSpec(p + "ffn_up.weight", (s.ffn, h), mat),
                TensorSpec(p + "post_attention_norm.weight", (h,), vec),
                TensorSpec(p + "post_ffw_norm.weight", (h,), vec), TensorSpec(p + "ffn_norm.weight", (h,), vec),
                TensorSpec(p + "attn_k_norm.weight", (s.head_dim,), vec), TensorSpec(p + "attn_k.weight", (kv, h), mat),
                TensorSpec(p + "attn_output.weight", (h, q), mat),
                TensorSpec(p + "attn_q_norm.weight", (s.head_dim,), vec), TensorSpec(p + "attn_q.weight", (q, h), mat),
                TensorSpec(p + "attn_v.weight", (kv, h), mat)]
    out.append(TensorSpec("output_norm.weight", (h,), vec))
    return out


def mxfp4_moe_type(name: str, shape: tuple[int, ...]):
    """The type llama.cpp's ``MXFP4_MOE`` gives a tensor of a converted (F16 / F32) gpt-oss file (llama-quant.cpp:
    ``tensor_allows_quantization``, then ``llama_tensor_get_type_impl``): 3-D expert weights MXFP4, every other
    quantizable weight (2-D, named ``.weight``, no norm, no router) Q8_0, the output and embedding included;
    the rest stays what the converter wrote, F32 for all of them here (1-D, biases, the router)."""
    import gguf

    if len(shape) < 2 or not name.endswith(".weight") or "_norm.weight" in name or "ffn_gate_inp." in name:
        return np.float32
    return gguf.GGMLQuantizationType.MXFP4 if len(shape) == 3 else gguf.GGMLQuantizationType.Q8_0


def _loader_order(name: str) -> tuple[int, str]:
    """llama.cpp's ``weight_name_comparer``: unnumbered tensors first, then by layer, then by name."""
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    return layer, name


def gpt_oss_specs(s: GptOssShape) -> list[TensorSpec]:
    """gpt-oss's tensors as ``MXFP4_MOE`` leaves them: types per ``mxfp4_moe_type``, in the quantizer's order."""
    h, q, kv, e, f = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.experts, s.expert_ffn
    shapes = {"token_embd.weight": (s.vocab, h), "output.weight": (s.vocab, h), "output_norm.weight": (h,)}
    for i in range(s.layers):
        p = f"blk.{i}."
        shapes.update({
            p + "attn_norm.weight": (h,), p + "post_attention_norm.weight": (h,),
            p + "attn_q.weight": (q, h), p + "attn_q.bias": (q,), p + "attn_k.weight": (kv, h),
            p + "attn_k.bias": (kv,), p + "attn_v.weight": (kv, h), p + "attn_v.bias": (kv,),
            p + "attn_output.weight": (h, q), p + "attn_output.bias": (h,), p + "attn_sinks.weight": (s.heads,),
            p + "ffn_gate_inp.weight": (e, h), p + "ffn_gate_inp.bias": (e,),
            p + "ffn_gate_exps.weight": (e, f, h), p + "ffn_gate_exps.bias": (e, f),
            p + "ffn_up_exps.weight": (e, f, h), p + "ffn_up_exps.bias": (e, f),
            p + "ffn_down_exps.weight": (e, h, f), p + "ffn_down_exps.bias": (e, h)})
    return [TensorSpec(n, shapes[n], mxfp4_moe_type(n, shapes[n])) for n in sorted(shapes, key=_loader_order)]


def specs(s, f32: bool = False) -> list[TensorSpec]:
    return gpt_oss_specs(s) if isinstance(s, GptOssShape) else gemma3_specs(s, f32)


def weight_counts(s) -> dict:
    """Weights in the file, and those a decoded token reads (the routed experts it uses, the lm_head: the tied
    embedding for Gemma, gpt-oss's own output matrix, not its embedding)."""
    total = active = 0
    for t in specs(s):
        n = t.count
        total += n
        if "_exps." in t.name:
            n = n * s.experts_used // s.experts
        if t.name != "token_embd.weight" or isinstance(s, Gemma3Shape):
            active += n
    return {"weights": total, "weights_per_token": active}


def _gemma3_metadata(w, s: Gemma3Shape, f32: bool) -> None:
    """Gemma3Model.set_gguf_parameters' keys, in the order the converter leaves them."""
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
    w.add_float32(f"{a}.rope.freq_base_swa", s.rope_local)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", s.eps)
    w.add_uint32(f"{a}.attention.key_length", s.head_dim)
    w.add_uint32(f"{a}.attention.value_length", s.head_dim)
    w.add_uint32("general.file_type", gguf.LlamaFileType.ALL_F32 if f32 else gguf.LlamaFileType.MOSTLY_F16)
    w.add_uint32(f"{a}.attention.sliding_window", s.window)
    w.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)


def _gpt_oss_metadata(w, s: GptOssShape) -> None:
    """GptOssModel.set_gguf_parameters' keys in the converter's order; the quantizer moves the quantization version
    and the file type to the end (after the tokenizer, written between them here)."""
    import gguf

    a = s.arch
    w.add_type("model")
    w.add_name(s.name)
    w.add_size_label(gguf.size_label(*w.get_total_parameter_count()))
    w.add_uint32(f"{a}.block_count", s.layers)
    w.add_uint32(f"{a}.context_length", s.context)
    w.add_uint32(f"{a}.embedding_length", s.hidden)
    w.add_uint32(f"{a}.feed_forward_length", s.expert_ffn)
    w.add_uint32(f"{a}.attention.head_count", s.heads)
    w.add_uint32(f"{a}.attention.head_count_kv", s.kv_heads)
    w.add_string(f"{a}.rope.scaling.type", "yarn")
    w.add_float32(f"{a}.rope.scaling.factor", s.yarn_factor)
    w.add_uint32(f"{a}.rope.scaling.original_context_length", s.yarn_original_context)
    w.add_float32(f"{a}.rope.scaling.yarn_beta_fast", s.yarn_beta_fast)
    w.add_float32(f"{a}.rope.scaling.yarn_beta_slow", s.yarn_beta_slow)
    w.add_float32(f"{a}.rope.freq_base", s.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", s.eps)
    w.add_uint32(f"{a}.expert_count", s.experts)
    w.add_uint32(f"{a}.expert_used_count", s.experts_used)
    w.add_uint32(f"{a}.attention.key_length", s.head_dim)
    w.add_uint32(f"{a}.attention.value_length", s.head_dim)
    w.add_uint32(f"{a}.attention.sliding_window", s.window)
    w.add_uint32(f"{a}.expert_feed_forward_length", s.expert_ffn)


# the standard deviation of ggml's MXFP4 values (kvalues_mxfp4, E2M1 doubled: 0, 1, 2, 3, 4, 6, 8, 12 and their
# negatives) at a scale of 1, i.e. E8M0 exponent 128 (the scale is halved: 2 ** (e - 128))
MXFP4_STD = math.sqrt(sum(v * v for v in (0, 1, 2, 3, 4, 6, 8, 12)) / 8)
Q8_STD = math.sqrt((255 ** 2 - 1) / 12)  # uniform integers in [-127, 127]


def q8_0_blocks(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Random Q8_0 rows of ``shape`` (numpy order): uint8 [..., cols / 32 * 34], each block an f16 scale (one for
    all: ggml's amax / 127 differs little between blocks of random values) and 32 int8 codes in [-127, 127]."""
    blocks = np.empty((*shape[:-1], shape[-1] // 32, 34), np.uint8)
    blocks[..., :2] = np.frombuffer(np.float16(std / Q8_STD).tobytes(), np.uint8)
    blocks[..., 2:] = rng.integers(-127, 128, size=(*shape[:-1], shape[-1] // 32, 32), dtype=np.int8).view(np.uint8)
    return blocks.reshape(*shape[:-1], -1)


def mxfp4_blocks(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Random MXFP4 rows: uint8 [..., cols / 32 * 17], each block an E8M0 exponent within one of the one giving
    ``std`` and 16 bytes of random E2M1 code pairs."""
    e = round(128 + math.log2(std / MXFP4_STD))
    blocks = np.empty((*shape[:-1], shape[-1] // 32, 17), np.uint8)
    blocks[..., 0] = rng.integers(e - 1, e + 2, size=blocks.shape[:-1], dtype=np.uint8)
    blocks[..., 1:] = rng.integers(0, 256, size=(*blocks.shape[:-1], 16), dtype=np.uint8)
    return blocks.reshape(*shape[:-1], -1)


def _data(rng: np.random.Generator, t: TensorSpec) -> np.ndarray:
    """Values that keep the forward finite: matrices of variance 1 / fan-in, norms 1 (the converter's 1 + w for
    Gemma), biases small, sinks of order 1; the float tensors of gpt-oss bfloat16 values (its checkpoint's)."""
    import gguf

    std = t.shape[-1] ** -0.5
    if t.dtype == gguf.GGMLQuantizationType.Q8_0:
        return q8_0_blocks(rng, t.shape, std)
    if t.dtype == gguf.GGMLQuantizationType.MXFP4:
        return mxfp4_blocks(rng, t.shape, std)
    if t.name.endswith("norm.weight"):
        return np.ones(t.shape, np.float32)
    if t.name.endswith(".bias"):
        return bf16_values(uniform(rng, t.shape, 0.02))
    if t.name.endswith("attn_sinks.weight"):
        return bf16_values(uniform(rng, t.shape, 1.0))
    x = uniform(rng, t.shape, std)
    return bf16_values(x) if "ffn_gate_inp." in t.name else x


def write_gemma3_gguf(out: Path, shape: Gemma3Shape, tokenizer_from: Path, seed: int = 0, f32: bool = False,
                      name: str | None = None) -> Path:
    """``out / name`` (default ``<shape.name>.F16.gguf``): the converter's file for a Gemma 3 checkpoint of ``shape``
    with random weights, written once."""
    path = out / (name or f"{shape.name}.{'F32' if f32 else 'F16'}.gguf")

    def metadata(w) -> None:
        _gemma3_metadata(w, shape, f32)
        copy_tokenizer(w, tokenizer_from, shape.vocab)

    return write_gguf(path, shape.arch, gemma3_specs(shape, f32), metadata, _data, seed)


def write_gpt_oss_gguf(out: Path, shape: GptOssShape, tokenizer_from: Path, seed: int = 0,
                       name: str | None = None) -> Path:
    """``out / name`` (default ``<shape.name>.MXFP4_MOE.gguf``): what ``MXFP4_MOE`` makes of a converted gpt-oss
    checkpoint of ``shape``, with random weights, written directly (tensor by tensor: memory is the largest one)."""
    import gguf

    path = out / (name or f"{shape.name}.{GPT_OSS_TYPE}.gguf")

    def metadata(w) -> None:
        _gpt_oss_metadata(w, shape)
        copy_tokenizer(w, tokenizer_from, shape.vocab)
        w.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
        w.add_uint32("general.file_type", gguf.LlamaFileType.MOSTLY_MXFP4_MOE)

    return write_gguf(path, shape.arch, gpt_oss_specs(shape), metadata, _data, seed)


def write_models(out: Path, models: list[str], gemma3_types: list[str], llama_python: str, tokenizer_from: Path,
                 tiny: bool = False, keep_f16: bool = False, log=print) -> list[tuple[Path, object]]:
    """Each model's files (written once): Gemma 3's F16 source quantized by llama.cpp into each of
    ``gemma3_types`` (the source deleted after unless ``keep_f16``), gpt-oss's MXFP4_MOE file.
    (path, shape) in order."""
    import time

    files = []
    for m in models:
        shape = (TINY if tiny else SHAPES)[m]
        log(f"{shape.name}: {weight_counts(shape)['weights'] / 1e9:.3f}B weights")
        if isinstance(shape, Gemma3Shape):
            targets = {t: out / f"{shape.name}.{t.upper()}.gguf" for t in gemma3_types}
            made = quantize_source(lambda: write_gemma3_gguf(out, shape, tokenizer_from), targets, llama_python,
                                   keep_f16, log)
            files += [(p, shape) for p in made]
        else:
            t0 = time.perf_counter()
            path = write_gpt_oss_gguf(out, shape, tokenizer_from)
            log(f"{path.name}: {path.stat().st_size / 1e9:.2f} GB ({time.perf_counter() - t0:.1f} s)")
            files.append((path, shape))
    return files
