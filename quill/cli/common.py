"""Options shared by the commands that load a model, and their translation into API objects."""

from __future__ import annotations

import argparse
import sys

from quill.platform import ISA_CHOICES


def add_model_args(p: argparse.ArgumentParser, positional: bool | str = False) -> None:
    """Model location and how to run it (``positional="optional"``: MODEL may be left out for the default)."""
    if positional == "optional":
        p.add_argument("model", nargs="?", default=None,
                       help="checkpoint directory, .gguf file or Hugging Face Hub id (default: the bundled "
                            "SmolLM2-135M-Instruct Q4_1)")
    elif positional:
        p.add_argument("model", help="checkpoint directory, .gguf file or Hugging Face Hub id")
    else:
        p.add_argument("--model", "-m", default=None,
                       help="checkpoint directory, .gguf file or Hugging Face Hub id (default: the bundled "
                            "SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--act-quant", choices=["none", "int8", "int8-group"], default=None,
                   help="int8: quantize activations of quantized layers (W4A8/W8A8), one scale per token; "
                        "int8-group: one per token and weight group (llama.cpp's choice, more accurate); "
                        "a W8A8 checkpoint always runs with its own")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="compute dtype (bfloat16 is accepted and runs as float32, with a warning: "
                        "slower than float32 on CPUs)")
    p.add_argument("--kernel", default=None, help="force one linear kernel by name (see `quill info`)")
    p.add_argument("--isa", choices=ISA_CHOICES, default="native",
                   help="avx2: run the kernel variants of an AVX2-only CPU (Zen 2/3) on this one, the same bits "
                        "(pair it with ATEN_CPU_CAPABILITY=avx2 so torch's own ops do the same)")
    p.add_argument("--moe-backend", default=None, help="force one MoE backend by name (grouped, reference)")
    p.add_argument("--max-model-len", type=int, default=None, help="cap the context window")
    p.add_argument("--kv-cache-dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                   help="element type of the KV cache (default auto: the compute dtype, float32); float16 or "
                        "bfloat16 halve its memory and what decode attention reads at long contexts")
    p.add_argument("--offline", action="store_true", help="resolve Hub ids from the local cache only")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bars (they show on a terminal when loading or scoring takes over a second)")
    p.add_argument("--cache-dir", default=None,
                   help="the prepacked cache's directory (default: $QUILL_CACHE_DIR, else ~/.cache/quill)")
    p.add_argument("--no-cache", action="store_true",
                   help="neither read nor write the prepacked cache (kernel layouts saved after a first load)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--min-tokens", type=int, default=0, help="EOS and stop tokens are masked until this many tokens")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS (until --max-tokens)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def build_llm(args, skip_tokenizer_init: bool = False, engine_config=None):
    from quill.engine.core import EngineConfig
    from quill.engine.llm import LLM
    if engine_config is None and getattr(args, "kv_cache_dtype", "auto") != "auto":
        engine_config = EngineConfig(kv_cache_dtype=args.kv_cache_dtype)
    return LLM(args.model, dtype=args.dtype, activation_quant=args.act_quant,
               threads=args.threads, kernel=args.kernel, moe_backend=args.moe_backend, isa=args.isa,
               max_model_len=args.max_model_len,
               offline=args.offline, skip_tokenizer_init=skip_tokenizer_init, engine_config=engine_config,
               progress=False if args.quiet else None, cache=False if args.no_cache else None,
               cache_dir=args.cache_dir)


def sampling_params(args):
    from quill.engine.sampling import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=args.stop, min_tokens=args.min_tokens, ignore_eos=args.ignore_eos)


def stream_to(out, chunks) -> object:
    """Write streamed text pieces as they come; return the last chunk (its timings and finish reason)."""
    last = None
    for chunk in chunks:
        if chunk.text:
            out.write(chunk.text)
            out.flush()
        last = chunk
    return last


def print_stats(last, file=None) -> None:
    file = file or sys.stderr
    if last is None:
        return
    t = last.timings
    print(f"[prompt: {t.prompt_tokens} tokens, {t.prefill_tps:.1f} tok/s | generation: {t.generated_tokens} "
          f"tokens, {t.decode_tps:.1f} tok/s | finish: {last.finish_reason}]", file=file)
