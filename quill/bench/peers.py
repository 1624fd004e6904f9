"""Peers driven through their own ``llama-bench`` binary on the same GGUF file as quill.

    --peer 'ik_llama.cpp=/work/ik-build/bin/llama-bench -rtr 1'     # its run-time repacking on
    --peer 'llama.cpp native=/work/llama-build/bin/llama-bench'      # mainline, built for this CPU

``NAME=BINARY [FLAGS...]``: the flags are the peer's own (ik_llama.cpp's recommended CPU settings,
say); the harness adds the file, the threads and what to time.  Prefill is ``-p P -n 0``; decode is
``G`` tokens after a ``P``-token prompt, as quill's runs time it: mainline spells that ``-p 0 -n G -d P``
(``--n-depth``), ik_llama.cpp ``-gp P,G``; a llama-bench with neither decodes from an empty context
(the line printed at start says so).  One repetition per call (``-r 1``, llama-bench warms up
first), so rounds alternate with quill's runs like the llama-cpp-python peer's.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from quill.errors import ConfigError


@dataclass(frozen=True)
class Peer:
    name: str
    argv: tuple[str, ...]  # the llama-bench binary and the peer's own flags
    depth: str | None  # "-d" (mainline), "-gp" (ik_llama.cpp) or None (decode from an empty context)

    @classmethod
    def parse(cls, spec: str) -> Peer:
        name, sep, command = spec.partition("=")
        argv = tuple(shlex.split(command))
        if not sep or not name.strip() or not argv:
            raise ConfigError(f"--peer {spec!r}: expected NAME=PATH/TO/llama-bench [FLAGS...]")
        binary = Path(argv[0])
        if not binary.is_file():
            raise ConfigError(f"--peer {name}: no llama-bench at '{binary}'")
        try:
            text = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
        except OSError as e:
            raise ConfigError(f"--peer {name}: '{binary}' does not run: {e}") from None
        usage = text.stdout + text.stderr
        if "--n-prompt" not in usage:
            raise ConfigError(f"--peer {name}: '{binary}' is not a llama-bench (no --n-prompt in its --help)")
        depth = "-d" if "--n-depth" in usage else "-gp" if "-gp <pp,tg>" in usage else None
        return cls(name.strip(), argv, depth)

    def describe(self) -> str:
        how = {"-d": "decode after the prompt (-d)", "-gp": "decode after the prompt (-gp)",
               None: "decode from an empty context (this llama-bench has no -d / -gp)"}[self.depth]
        return f"{self.name}: {shlex.join(self.argv)}; {how}"

    def _tps(self, path: Path, threads: int, what: list[str]) -> tuple[float, str]:
        """(tokens/s, the binary's build commit) of one llama-bench test."""
        cmd = [*self.argv, "-m", str(path), "-t", str(threads), "-r", "1", "-o", "json", *what]
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if p.returncode:
            raise RuntimeError(f"{self.name} failed ({shlex.join(cmd)}): {p.stderr.strip()[-2000:]}")
        try:
            rows = json.loads(p.stdout[p.stdout.index("["):])
            return float(rows[-1]["avg_ts"]), str(rows[-1].get("build_commit", "?"))
        except (ValueError, KeyError, IndexError) as e:
            raise RuntimeError(f"{self.name}: unreadable llama-bench output ({e}): {p.stdout[-500:]}") from None

    def run(self, path: Path, prompt: int, gen: int, threads: int) -> dict:
        """Prefill and decode tokens/s of one round, as ``quill.bench.llamacpp.run_llamacpp`` reports them."""
        prefill, build = self._tps(path, threads, ["-p", str(prompt), "-n", "0"])
        if self.depth == "-d":
            decode_args = ["-p", "0", "-n", str(gen), "-d", str(prompt)]
        elif self.depth == "-gp":
            decode_args = ["-p", "0", "-n", "0", "-gp", f"{prompt},{gen}"]
        else:
            decode_args = ["-p", "0", "-n", str(gen)]
        decode, _ = self._tps(path, threads, decode_args)
        return {"prefill_tps": prefill, "decode_tps": decode, "build": build}
