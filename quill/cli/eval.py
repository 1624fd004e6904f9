"""``quill eval``: perplexity over a text, and KL divergence of a model against a base.

    quill eval perplexity MODEL --text FILE [--context 512] [--stride 256] [--max-tokens N] [--json [FILE]]
    quill eval compare BASE [OTHER] --text FILE [--other-act-quant none] [--other-kv-cache-dtype float32]

BASE may be a model or a base-scores file written earlier by ``--save-base``; OTHER defaults
to BASE run with the ``--other-*`` settings (e.g. W4A16 against W4A8 of one checkpoint).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from quill.cli.common import add_model_args, add_option_args, build_llm, run_options
from quill.errors import EvalError

OTHER_OPTIONS = ("activation_quant", "kv_cache_dtype", "kernel", "moe_backend")


def register(sub) -> None:
    p = sub.add_parser("eval", help="accuracy: perplexity, KL divergence against a base")
    esub = p.add_subparsers(dest="eval_command", required=True)

    pp = esub.add_parser("perplexity", help="strided-window perplexity of a model over a text")
    add_model_args(pp, positional="optional")
    _add_text_args(pp)
    pp.set_defaults(func=run_perplexity)

    pc = esub.add_parser("compare", help="KL divergence, top-1 agreement and PPL ratio of OTHER against BASE")
    add_model_args(pc, positional="optional")
    pc.add_argument("other", nargs="?", default=None,
                    help="the model compared with BASE (default: BASE itself with the --other-* settings)")
    # OTHER's own run options (--other-act-quant, --other-kernel, --other-kv-cache-dtype); unset: BASE's
    add_option_args(pc, prefix="other-", only=OTHER_OPTIONS, help_suffix=" -- for OTHER (default: as BASE)")
    pc.add_argument("--top-k", type=int, default=128,
                    help="base log-probabilities kept per token for KL (default 128; the rest is one outcome)")
    pc.add_argument("--save-base", default=None, metavar="FILE",
                    help="write the base's scores (safetensors) to reuse as BASE later")
    _add_text_args(pc)
    pc.set_defaults(func=run_compare)


def _add_text_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", default=None, metavar="FILE", help="UTF-8 text file to score")
    src.add_argument("--pydoc-topics", action="store_true",
                     help="score the English prose every CPython ships (pydoc_data.topics, ~65k words)")
    src.add_argument("--dataset", default=None, metavar="NAME[:CONFIG[:SPLIT]]",
                     help="a Hugging Face dataset's 'text' column via the datasets library (online)")
    p.add_argument("--context", type=int, default=None,
                   help="window length in tokens (default 512, or the model's window if smaller)")
    p.add_argument("--stride", type=int, default=None,
                   help="a window starts every STRIDE tokens (default half the window)")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the text")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the figures as JSON (to stdout when no FILE is given)")


def read_text(args) -> str:
    """The text to score, from the source the arguments name (an EvalError if it is empty or unreadable)."""
    if args.pydoc_topics:
        from pydoc_data.topics import topics
        text = "\n\n".join(topics[k] for k in sorted(topics))
    elif args.dataset is not None:
        text = _dataset_text(args.dataset)
    else:
        try:
            text = Path(args.text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise EvalError(f"--text {args.text}: cannot read it as UTF-8 text: {e}") from e
    if not text.strip():
        raise EvalError(f"the text to score is empty ({_source(args)})")
    return text


def _source(args) -> str:
    return "pydoc_data.topics" if args.pydoc_topics else (
        f"--dataset {args.dataset}" if args.dataset else f"--text {args.text}")


def _dataset_text(spec: str) -> str:
    try:
        import datasets
    except ImportError as e:
        raise EvalError("--dataset needs the datasets library (pip install datasets); or pass --text FILE") from e
    name, config, split = (spec.split(":") + [None, None])[:3]
    try:
        ds = datasets.load_dataset(name, config or None, split=split or "test")
    except Exception as e:  # the datasets library raises many types (network, missing config, ...)
        raise EvalError(f"--dataset {spec}: cannot load it: {type(e).__name__}: {e}") from e
    if "text" not in ds.column_names:
        raise EvalError(f"--dataset {spec}: has no 'text' column (columns: {', '.join(ds.column_names)})")
    return "\n\n".join(ds["text"])


def tokenize(llm, args, text: str) -> list[int]:
    if llm.tokenizer is None:
        raise EvalError("evaluation needs the model's tokenizer")
    tokens = llm.tokenizer.encode(text)
    if args.max_tokens is not None:
        if args.max_tokens < 2:
            raise EvalError(f"--max-tokens must be at least 2, found {args.max_tokens}")
        tokens = tokens[:args.max_tokens]
    return tokens


class Progress:
    """A tqdm bar over processed tokens on stderr (off with --quiet or when stderr is not a terminal)."""

    def __init__(self, args, total: int, desc: str):
        from tqdm import tqdm
        self.bar = tqdm(total=total, desc=desc, unit="tok", file=sys.stderr,
                        disable=args.quiet or not sys.stderr.isatty())

    def __call__(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def _emit(args, result) -> None:
    if args.json is None:
        print(result.report())
        return
    text = json.dumps(result.as_dict(), indent=2)
    if args.json == "-":
        print(text)
    else:
        Path(args.json).write_text(text + "\n")
        print(result.report())


def window_args(args, llm) -> tuple[int, int]:
    """(context, stride) from the arguments, defaulting to 512 (or the model's window) and half of it."""
    context = min(512, llm.context_length) if args.context is None else args.context
    return context, max(1, context // 2) if args.stride is None else args.stride


def eval_llm(args, context: int | None = None, options=None):
    """The model, its context capped at the window when the user set no cap: the KV pool is then sized
    for windows (16 sequences x 512 tokens: ~0.4 GB on the default model) instead of full contexts."""
    options = options or run_options(args)
    if options.max_model_len is None:
        options = dataclasses.replace(options, max_model_len=context or args.context or 512)
    return build_llm(args, options=options)


def _windows_total(n: int, context: int, stride: int, max_context: int) -> int:
    from quill.eval.perplexity import make_windows
    return sum(w.end - w.begin for w in make_windows(n, context, stride, max_context))


def run_perplexity(args) -> int:
    from quill.eval.perplexity import perplexity
    text = read_text(args)  # before the model loads: a bad text fails fast
    llm = eval_llm(args)
    tokens = tokenize(llm, args, text)
    context, stride = window_args(args, llm)
    bar = Progress(args, _windows_total(len(tokens), context, stride, llm.context_length), "perplexity")
    try:
        result = perplexity(llm, tokens, context, stride, progress=bar)
    finally:
        bar.close()
    _emit(args, result)
    return 0


def _describe(model: str | None, llm) -> str:
    """What ran: the model, its activations and KV cache as resolved (not "auto"), dtype, a forced kernel."""
    parts = [model or "default model", f"act-quant {llm.activation.value}", f"kv-cache {llm.engine.kv_cache_dtype}",
             llm.options.dtype]
    if llm.options.kernel:
        parts.append(f"kernel {llm.options.kernel}")
    return ", ".join(parts)


def run_compare(args) -> int:
    from quill.eval.compare import BaseScores, compare, score_base
    base_file = args.model is not None and args.model.endswith(".safetensors")
    if base_file and args.other is None:
        raise EvalError("BASE is a saved base-scores file: name the OTHER model to compare with it")
    other_args = argparse.Namespace(**vars(args))
    other_args.model = args.other or args.model
    other_options = run_options(args, prefix="other_")
    text = read_text(args)  # before any model loads: a bad text fails fast
    if base_file:
        base = BaseScores.load(args.model)
        if args.context not in (None, base.context) or args.stride not in (None, base.stride):
            raise EvalError(f"{args.model} was scored with --context {base.context} --stride {base.stride}; "
                            f"found --context {args.context} --stride {args.stride}")
    else:
        llm = eval_llm(args)
        tokens = tokenize(llm, args, text)
        context, stride = window_args(args, llm)
        bar = Progress(args, _windows_total(len(tokens), context, stride, llm.context_length), "base")
        try:
            base = score_base(llm, tokens, context, stride, args.top_k,
                              _describe(args.model, llm), progress=bar)
        finally:
            bar.close()
        del llm  # the base's memory goes before OTHER loads
        if args.save_base:
            base.save(args.save_base)
    other = eval_llm(other_args, base.context, other_options)
    tokens = tokenize(other, other_args, text)
    bar = Progress(args, _windows_total(len(tokens), base.context, base.stride, other.context_length), "other")
    try:
        result = compare(base, other, tokens, _describe(other_args.model, other), progress=bar)
    finally:
        bar.close()
    _emit(args, result)
    return 0
