"""The ``quill`` command: a thin layer over the Python API, one module per subcommand.

Each module in ``COMMANDS`` defines ``register(subparsers)``, which adds its parser
and sets ``func`` to a callable taking the parsed args and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from quill.errors import QuillError

COMMANDS = ("quill.cli.info", "quill.cli.generate", "quill.cli.chat", "quill.cli.inspect", "quill.cli.bench",
            "quill.cli.serve", "quill.cli.eval")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quill", description="CPU inference for quantized LLM checkpoints")
    parser.add_argument("-v", "--verbose", action="store_true", help="log kernel choices and loading details")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except QuillError as e:
        print(f"quill: error: {e}", file=sys.stderr)
        return 2
