"""``quill generate``: answer one prompt, streaming the text to the terminal."""

from __future__ import annotations

import sys

from quill.cli.common import (
    add_model_args,
    add_sampling_args,
    build_llm,
    keep_until_exit,
    print_stats,
    sampling_params,
    stream_to,
)


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt (streamed)")
    p.add_argument("prompt", help="the prompt text")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--system", default=None, help="system message (chat template only)")
    p.add_argument("--no-chat-template", action="store_true",
                   help="send the prompt as raw text even when the model has a chat template")
    p.set_defaults(func=run)


def run(args) -> int:
    llm = build_llm(args)
    keep_until_exit(args)
    params = sampling_params(args)
    if llm.tokenizer.has_chat_template and not args.no_chat_template:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": args.prompt}]
        chunks = llm.stream_chat(messages, params)
    else:
        chunks = llm.stream(args.prompt, params)
    last = stream_to(sys.stdout, chunks)
    print()
    print_stats(last)
    return 0
