"""``quill chat``: an interactive conversation, streamed; ``/reset`` forgets it, ``/exit`` leaves.

Ctrl-C while an answer is being written stops that answer (the request is aborted and its
KV blocks freed) and returns to the prompt with the conversation kept; the partial answer
stays in it.  Each turn's prompt starts with the previous turns, which the engine's prefix
cache still holds, so only the new tokens are computed.
"""

from __future__ import annotations

import sys

from quill.cli.common import add_model_args, add_sampling_args, build_llm, keep_until_exit, sampling_params, stream_to
from quill.errors import GenerationError

HELP = "type a message; /reset starts over, /exit (or end of input) quits"


def register(sub) -> None:
    p = sub.add_parser("chat", help="chat with a model interactively (reads stdin)")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--system", default=None, help="system message")
    p.set_defaults(func=run)


def _fresh(system: str | None) -> list[dict]:
    return [{"role": "system", "content": system}] if system else []


def run(args) -> int:
    llm = build_llm(args)
    keep_until_exit(args)
    params = sampling_params(args)
    history = _fresh(args.system)
    interactive = sys.stdin.isatty()
    print(HELP, file=sys.stderr)
    while True:
        if interactive:
            print(">>> ", end="", flush=True)
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does (end of input quits)
            print(file=sys.stderr)
            continue
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            history = _fresh(args.system)
            print("[conversation reset]", file=sys.stderr)
            continue
        history.append({"role": "user", "content": text})
        reply = _answer(llm, history, params)
        if reply is None:
            history.pop()
        else:
            history.append({"role": "assistant", "content": reply})
    return 0


def _answer(llm, history: list[dict], params) -> str | None:
    """Stream the reply; drop the oldest exchanges while the conversation is longer than the context."""
    start = 1 if history and history[0]["role"] == "system" else 0
    while True:
        pieces: list[str] = []
        try:
            chunks = llm.stream_chat(history, params)
            try:
                last = stream_to(sys.stdout, (pieces.append(c.text) or c for c in chunks))
            finally:
                chunks.close()  # on Ctrl-C too: the engine aborts the request and frees its blocks
            print(flush=True)
            return "".join(pieces) if last is not None else ""
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr, flush=True)
            return "".join(pieces)
        except GenerationError as e:
            if "context window" not in str(e) or len(history) - start <= 1:
                print(f"quill: {e}", file=sys.stderr)
                return None
            del history[start:start + 2]  # forget the oldest user/assistant exchange
