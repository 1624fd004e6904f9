"""Options shared by the commands that load a model, and their translation into API objects."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys

from quill.options import Flag, RunOptions


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
    add_option_args(p)
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bars (they show on a terminal when loading or scoring takes over a second) "
                        "and no load line")


def add_option_args(p, prefix: str = "", only: tuple[str, ...] | None = None, help_suffix: str = "") -> None:
    """One flag per ``RunOptions`` field (its metadata: name, help, choices), ``dest`` the field's name.

    ``prefix`` / ``only``: a second set for another model (``quill eval compare --other-act-quant``), whose
    flags default to None (= as the first set)."""
    for f in dataclasses.fields(RunOptions):
        if only is not None and f.name not in only:
            continue
        flag: Flag = f.metadata["flag"]
        name = "--" + prefix + flag.name.removeprefix("--")
        default = None if prefix else f.default
        kw = {"dest": prefix.replace("-", "_") + f.name, "help": flag.help + help_suffix}
        if flag.kind == "bool":  # --offline sets True, --no-cache sets cache=False; absent: the default
            p.add_argument(name, action="store_const", const=not flag.negated, default=default, **kw)
        else:
            p.add_argument(name, type=int if flag.kind == "int" else str, choices=flag.choices or None,
                           default=default, **kw)


def run_options(args, prefix: str = "") -> RunOptions:
    """The ``RunOptions`` the parsed flags give (with ``prefix``: those flags where given, else the first set)."""
    values = {}
    for f in dataclasses.fields(RunOptions):
        value = getattr(args, prefix + f.name, None) if prefix else getattr(args, f.name)
        values[f.name] = getattr(args, f.name) if value is None and prefix else value
    return RunOptions(**values)


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


def build_llm(args, skip_tokenizer_init: bool = False, engine_config=None, options: RunOptions | None = None):
    """``quill.LLM`` with the options the flags give (or ``options``); says on stderr which arithmetic runs."""
    from quill.engine.llm import LLM
    llm = LLM(args.model, **(options or run_options(args)).llm_kwargs(), skip_tokenizer_init=skip_tokenizer_init,
              engine_config=engine_config, progress=False if args.quiet else None)
    if not args.quiet:
        print("quill: " + "; ".join(f"{k}: {v}" for k, v in llm.arithmetic.items()), file=sys.stderr, flush=True)
    return llm


def keep_until_exit(args) -> None:
    """Once a command that runs one model until the process ends has loaded it: collect what loading left
    behind, then freeze the rest (``gc.freeze``: every object alive now, the imports and the model, moves to
    the permanent generation), as vLLM does after start-up.  The cyclic collector then never walks those
    objects again, neither in a server's full collections nor at interpreter shutdown, where the walk took
    0.6-1.3 s after the last output on a 2-core machine.  Objects made later are collected as before.

    Only in the ``quill`` program itself (``args.program``): a process calling ``quill.cli.main`` (the tests)
    makes and drops many models, which a freeze would keep alive."""
    if getattr(args, "program", False):
        gc.collect()
        gc.freeze()


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
