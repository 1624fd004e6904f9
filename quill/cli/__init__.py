"""The ``quill`` command: a thin layer over the Python API, one module per subcommand.

Each module in ``COMMANDS`` defines ``register(subparsers)``, which adds its parser
and sets ``func`` to a callable taking the parsed args and returning an exit code.  A
``QuillError`` is one line on stderr and exit code 2; Ctrl-C (SIGINT) anywhere outside a
command's own handling (``quill chat`` keeps the conversation) ends quietly with 130, and a closed
stdout (``quill info | head``) with 141.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import select
import signal
import sys
import threading
from contextlib import contextmanager

from quill.errors import QuillError

COMMANDS = ("quill.cli.info", "quill.cli.generate", "quill.cli.chat", "quill.cli.inspect", "quill.cli.bench",
            "quill.cli.serve", "quill.cli.eval", "quill.cli.cache")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``quill`` parser; with ``command`` (a subcommand's name), only that subcommand is registered, so a
    run imports what it uses and nothing else (``quill generate`` never imports the benchmarks)."""
    parser = argparse.ArgumentParser(prog="quill", description="CPU inference for quantized LLM checkpoints")
    parser.add_argument("-v", "--verbose", action="store_true", help="log kernel choices and loading details")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = [m for m in COMMANDS if m.rpartition(".")[2] == command] or COMMANDS
    for name in chosen:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit code (2: a QuillError, reported in one line; 130: Ctrl-C and 141: stdout's
    reader gone, as shells use).  ``argv`` None: the process's own command line (the ``quill`` program and
    ``python -m quill``), which alone may freeze what it loaded (``common.keep_until_exit``)."""
    try:
        return _run(sys.argv[1:] if argv is None else argv, program=argv is None)
    except KeyboardInterrupt:  # loading, generating, starting a server: stop without a traceback
        print("\n[interrupted]", file=sys.stderr, flush=True)  # the newline ends a half-written answer's line
        return 130
    except BrokenPipeError:
        if not _stdout_reader_gone():  # another pipe broke (a child process, a socket): a real error
            raise
        # the reader of stdout left (quill info | head): stop quietly, as shell tools do.  Python flushes
        # stdout again at exit and would fail the same way: point it at /dev/null first
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports POLLERR for such a pipe)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # stdout closed or not a file descriptor
        return False


def _run(argv: list[str], program: bool = False) -> int:
    command = next((a for a in argv if not a.startswith("-")), None)  # the only global option takes no value
    args = build_parser(command).parse_args(argv)
    args.program = program
    args.argv = list(argv)  # the command line as given (benchmarks record it)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        if getattr(args, "check", None) is not None:
            args.check(args)  # a command's flag checks: a mistyped flag is refused before torch loads
        _import_numpy()
        if args.command in _NATIVE_COMMANDS:
            _import_native()
        return int(args.func(args) or 0)
    except QuillError as e:
        print(f"quill: error: {e}", file=sys.stderr)
        return 2


# the commands that run torch and the native kernels (the rest answer without importing torch)
_NATIVE_COMMANDS = frozenset({"generate", "chat", "inspect", "serve", "bench", "eval", "info"})


@contextmanager
def _interrupt_after():
    """Hold a Ctrl-C until the block ends, then raise it: torch's and the native module's imports run Python
    from C++, and a KeyboardInterrupt raised there can end the process with an abort (pybind11's
    error_already_set thrown where C++ cannot unwind) instead of quill's 130."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            raise KeyboardInterrupt


def _import_native() -> None:
    """Import torch and the native kernels (a second or two) with Ctrl-C held until both are in."""
    with _interrupt_after():
        try:
            import torch  # noqa: F401

            from quill import native
            native.load()
        except ImportError:  # the command reports what is missing when it needs it
            pass


def _import_numpy() -> None:
    """Import numpy before anything imports torch: torch imports it from C++ and drops whatever that import
    raises, a Ctrl-C too (the command then ran on to its end); imported here, a Ctrl-C during it is raised."""
    try:
        import numpy  # noqa: F401
    except ImportError:  # torch runs without numpy
        pass
